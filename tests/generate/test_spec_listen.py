"""The host's per-token rules over speculative rounds' tokens: plain decoding's order and reasons."""

import numpy as np
import pytest

from aotlm.generate import spec_listen

EOS = np.array([9])


def _host(tokens, budget, skip=1):
    """A loop state's numpy copies: one row, ``skip`` prompt columns, then ``tokens``."""
    out = np.zeros((1, 16), np.int32)
    out[0, skip : skip + len(tokens)] = tokens
    return {
        "out": out,
        "n_out": np.array([skip + len(tokens)]),
        "budget": np.array([skip + budget]),
        "done": np.array([False]),
    }


def _listen(call):
    listen, want = spec_listen.split(call, 1, 2, 50, "prompt_lookup_num_tokens")
    return listen, want


def test_split_takes_the_listening_keys():
    call = dict(stop_sequences=[[3, 4], [7]], return_dict=True, temperature=0.5)
    listen, want = _listen(call)
    assert want and call == {"temperature": 0.5}  # the rest stays for the rounds
    assert listen.stops == [[(3, 4), (7,)]] and listen.active and listen.rows == 1
    assert not _listen({})[0].active
    with pytest.raises(ValueError, match="not both"):
        _listen(dict(stopping_criteria=[len], stopping_criteria_list=[len]))
    with pytest.raises(ValueError, match="a streamer follows one prompt with draft_model, got 2"):
        spec_listen.split(dict(streamer=_Streamer()), 2, 2, 50, "draft_model")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        _listen(dict(stop_sequences=[[60]]))


def test_check_cuts_at_the_first_rule_in_plain_decodings_order():
    listen, _ = _listen(dict(stop_sequences=[[3, 4]]))
    host, seen, reason = _host([5, 3, 4, 6, 6], 10), np.array([1]), np.zeros(1, np.int32)
    assert spec_listen.check(listen, host, seen, reason, np.zeros((1, 1)), 1, EOS)
    assert host["n_out"][0] == 4 and host["done"][0] and seen[0] == 4  # cut after the stop, kept
    assert spec_listen.finish_reasons(reason, host["out"][:, 1:], host["n_out"] - 1, EOS) == ["stop_sequence"]
    # a stop sequence at the budget's last token wins over the length limit; nothing left to cut
    host, reason = _host([5, 3, 4], 3), np.zeros(1, np.int32)
    host["done"][0] = True
    assert not spec_listen.check(listen, host, np.array([1]), reason, np.zeros((1, 1)), 1, EOS)
    assert reason[0] == spec_listen.FinishReason.STOP_SEQUENCE
    # eos wins: a row the graph ended at an eos id keeps that reason
    listen, _ = _listen(dict(stop_sequences=[[9]]))
    host, reason = _host([5, 9], 10), np.zeros(1, np.int32)
    assert not spec_listen.check(listen, host, np.array([1]), reason, np.zeros((1, 1)), 1, EOS)
    assert spec_listen.finish_reasons(reason, host["out"][:, 1:], host["n_out"] - 1, EOS) == ["eos"]


def test_criteria_see_each_prefix_but_not_the_last_token():
    asked = []

    def ends_on_6(seqs, scores):
        asked.append(np.asarray(seqs).shape[1])
        return np.asarray(seqs)[:, -1] == 6

    listen, _ = _listen(dict(stopping_criteria=ends_on_6))
    host, reason = _host([5, 7, 6, 6], 10), np.zeros(1, np.int32)
    prompt = np.zeros((1, 1))
    assert spec_listen.check(listen, host, np.array([1]), reason, prompt, 1, EOS)
    assert asked == [2, 3, 4] and host["n_out"][0] == 4 and reason[0] == spec_listen.FinishReason.STOPPED
    asked.clear()  # at the budget's last token the length limit ends the row, as in plain decoding
    host, reason = _host([5, 6], 2), np.zeros(1, np.int32)
    host["done"][0] = True
    assert not spec_listen.check(listen, host, np.array([1]), reason, prompt, 1, EOS)
    assert asked == [2] and reason[0] == spec_listen.FinishReason.RUNNING
    assert spec_listen.finish_reasons(reason, host["out"][:, 1:], host["n_out"] - 1, EOS) == ["length"]


def test_the_streamer_gets_row_0s_new_tokens_once():
    s = _Streamer()
    listen, _ = _listen(dict(streamer=s))
    host, seen, reason = _host([5, 7, 6], 10), np.array([1]), np.zeros(1, np.int32)
    spec_listen.check(listen, host, seen, reason, np.zeros((1, 1)), 1, EOS)
    spec_listen.check(listen, host, seen, reason, np.zeros((1, 1)), 1, EOS)  # nothing new: nothing put
    assert [x.tolist() for x in s.puts] == [[[5, 7, 6]]]


class _Streamer:
    def __init__(self):
        self.puts = []

    def put(self, value):
        self.puts.append(np.asarray(value))

    def end(self):
        pass
