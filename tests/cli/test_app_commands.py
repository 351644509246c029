"""The `aotlm` command line: compile (table, cache hits, dry run, memory check), sample, cache tools."""

import json

import pytest

from aotlm.cli.app import main
from aotlm.tiny import make_tiny_gpt2

SHAPE = ["--batch-size", "2", "--n-positions", "32,64", "--context-length-estimate", "8,16"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_gpt2(tmp_path_factory.mktemp("tiny") / "ckpt", vocab_size=97, n_embd=32, n_layer=2)


def test_compile_then_hits_and_cache_tools(tiny, tmp_path, capsys):
    cache = str(tmp_path / "cache")
    assert main(["compile", str(tiny), *SHAPE, "--cache-dir", cache]) == 0
    out = capsys.readouterr().out
    assert "graph" in out and "compile s" in out and out.count("miss") == 7
    assert "total: 7 graphs (0 from cache)" in out
    assert main(["compile", str(tiny), *SHAPE, "--cache-dir", cache]) == 0
    assert "total: 7 graphs (7 from cache)" in capsys.readouterr().out
    assert main(["cache", "list", "--cache-dir", cache]) == 0
    listing = capsys.readouterr().out
    assert "7 entries" in listing and "decode 64" in listing and "gpt2" in listing
    assert main(["cache", "verify", "--cache-dir", cache]) == 0
    assert "7 entries checked, 0 corrupt" in capsys.readouterr().out
    victim = next(p for p in (tmp_path / "cache").iterdir() if (p / "executable.bin").exists())
    (victim / "executable.bin").write_bytes(b"broken")
    assert main(["cache", "verify", "--cache-dir", cache]) == 1
    assert "1 corrupt" in capsys.readouterr().out
    assert main(["cache", "clear", "--older-than", "1", "--cache-dir", cache]) == 0
    assert "removed 0 entries" in capsys.readouterr().out
    assert main(["cache", "clear", "--cache-dir", cache]) == 0
    assert "removed 7 entries" in capsys.readouterr().out
    assert main(["cache", "clear", "--cache-dir", str(tmp_path / "typo")]) == 0
    assert "nothing to clear" in capsys.readouterr().out and not (tmp_path / "typo").exists()


def test_config_file_dry_run_and_memory_check(tiny, tmp_path, capsys):
    cfg = tmp_path / "buckets.json"
    cfg.write_text(json.dumps({"batch_size": 2, "n_positions": [32, 64], "context_length_estimate": [8, 16]}))
    assert main(["compile", str(tiny), "--config", str(cfg), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "7 graphs would be compiled" in out and "prefill  16x64" in out and "KV cache" in out
    assert main(["compile", str(tiny), "--config", str(cfg), "--device-memory-gb", "0.0001"]) == 2
    assert "GiB per device" in capsys.readouterr().err
    cfg.write_text(json.dumps({"batch": 2}))
    assert main(["compile", str(tiny), "--config", str(cfg)]) == 2  # a user error: exit 2, one line
    assert "unknown keys" in capsys.readouterr().err


def test_sample_prints_rows_and_reports_bad_input(tiny, tmp_path, capsys):
    args = ["sample", str(tiny), *SHAPE, "--cache-dir", str(tmp_path / "c")]
    assert main([*args, "--prompt-ids", "1,2,3", "--prompt-ids", "4,5,6", "--max-new-tokens", "5"]) == 0
    rows = capsys.readouterr().out.strip().splitlines()
    assert len(rows) == 2 and [len(r.split(",")) for r in rows] == [8, 8]
    assert main([*args, "--prompt-ids", "1,2,300"]) == 2
    assert "not a valid token id" in capsys.readouterr().err
    assert main([*args, "--prompt-ids", "1,2", "--max-new-tokens", "100"]) == 2
    assert "exceeds n_positions=64" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # an unknown flag names the command it was given to
        main([*args, "--prompt-ids", "1,2", "--bogus", "3"])
    assert e.value.code == 2 and capsys.readouterr().err == (
        "aotlm sample: error: unrecognized arguments: --bogus 3; see 'aotlm sample --help'\n"
    )


def test_a_prompt_without_its_flag_is_named_with_the_fix(capsys):
    with pytest.raises(SystemExit) as e:  # before anything loads
        main(["generate", "--model", "smollm2", "what is it"])
    assert e.value.code == 2 and capsys.readouterr().err == (
        "aotlm generate: error: unrecognized arguments: what is it; give a prompt as --prompt 'what is it'; "
        "see 'aotlm generate --help'\n"
    )


def test_vllm_flag_names_are_aliases():
    """A vLLM command line's shape flags mean the same here (``vllm serve M --max-model-len ...``)."""
    from aotlm.cli.app import build_parser

    p = build_parser()
    vllm = p.parse_args(
        ["serve", "m", "--max-model-len", "2048", "--max-num-seqs", "4", "-tp", "2", "-pp", "1"]
    )
    ours = p.parse_args(["serve", "m", "--n-positions", "2048", "--batch-size", "4", "--tp-degree", "2",
                         "--pp-degree", "1"])  # fmt: skip
    keys = ("n_positions", "batch_size", "tp_degree", "pp_degree")
    assert [getattr(vllm, k) for k in keys] == [getattr(ours, k) for k in keys] == [[2048], 4, 2, 1]
    long = p.parse_args(["compile", "m", "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"])
    assert (long.tp_degree, long.pp_degree) == (2, 2)


def test_vllm_lora_flags(tmp_path, capsys):
    from aotlm.cli.app import build_parser
    from aotlm.cli.common import model_kwargs

    p, ckpt = build_parser(), str(make_tiny_gpt2(tmp_path / "m"))

    def lora(*flags):
        kw = model_kwargs(p.parse_args(["serve", ckpt, *flags]))
        return {k: kw[k] for k in ("lora_adapters", "max_loras") if k in kw}

    two = lora(
        "--enable-lora", "--lora-modules", "sql=/a", '{"name": "poet", "path": "/b"}', "--lora", "c=/c"
    )
    assert two == {"lora_adapters": {"sql": "/a", "poet": "/b", "c": "/c"}}
    assert lora("--enable-lora") == {"max_loras": 1}  # vLLM's default: one slot, loaded at run time
    assert lora("--enable-lora", "--max-loras", "3") == {"max_loras": 3}
    with pytest.raises(SystemExit) as e:
        p.parse_args(["serve", "m", "--lora-modules", "sql"])
    assert e.value.code == 2 and 'expected NAME=DIR or {"name": NAME, "path": DIR}' in capsys.readouterr().err
