"""stub"""


def register(sub) -> None:
    pass
