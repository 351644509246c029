"""from_pretrained / pipeline keyword arguments checked by name before anything loads: a typo gets
the close names, a transformers argument gets aotlm's way of saying it."""

import pytest

import aotlm
from aotlm import AutoModelForSampling
from aotlm.api.arguments import TRANSFORMERS_ARGUMENTS, check_names


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(batchsize=2), r"unexpected keyword argument 'batchsize'; did you mean 'batch_size'"),
        (dict(n_position=64), r"did you mean 'n_positions'"),
        (
            dict(torch_dtype="bfloat16"),
            r"does not take 'torch_dtype' \(a transformers argument\): .*amp='f32'",
        ),
        (dict(device_map="auto"), r"'device_map' .* tp_degree=N / pp_degree=N"),
        (dict(load_in_8bit=True), r"aotlm's is quant='int8'"),
        (dict(zzz=1), r"unexpected keyword argument 'zzz'; it takes \[.*'amp'.*'tp_degree'\]"),
    ],
)
def test_unknown_model_arguments_are_named_before_loading(kw, match, tmp_path):
    missing = tmp_path / "not-even-a-checkpoint"  # the names are checked before the path is looked at
    with pytest.raises(TypeError, match=r"^from_pretrained\(\) .*" + match):
        AutoModelForSampling.from_pretrained(missing, **kw)
    with pytest.raises(TypeError, match=r"^pipeline\(\) .*" + match):
        aotlm.pipeline("text-generation", model=str(missing), **kw)


def test_every_argument_the_readme_names_is_accepted():
    known = AutoModelForSampling.model_arguments()
    readme = {
        "batch_size",
        "n_positions",
        "context_length_estimate",
        "tp_degree",
        "pp_degree",
        "amp",
        "quant",
    }
    readme |= {
        "kv_cache_dtype",
        "fuse_qkv",
        "gqa",
        "compile_cache",
        "bucket_config",
        "neuron_config",
        "scoring",
    }
    readme |= {"num_beams", "prompt_batch_size", "speculation_length", "lora_adapters", "merge_lora"}
    assert readme <= known and "model_types" not in known
    assert not set(TRANSFORMERS_ARGUMENTS) & known  # a hint never hides a real argument
    check_names(["amp", "quant"], known, "x")  # known names pass
