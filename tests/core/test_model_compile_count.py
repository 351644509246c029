"""Each bucket graph compiles exactly once per process; sample() after compile() compiles nothing."""

import numpy as np
from compile_counter import count_compiles

from aotlm import AutoModelForSampling


def test_each_graph_compiles_once_and_sample_compiles_nothing(llama_path):
    with count_compiles() as load:
        model = AutoModelForSampling.from_pretrained(
            llama_path,
            batch_size=2,
            n_positions=[32, 64],
            context_length_estimate=[8, 16],
            compile_cache=False,
        )
    assert load["backend"] == 0, "loading weights and allocating the KV cache must not compile"
    keys = model.graph_keys()
    assert keys == [
        ("prefill", 8, 8),
        ("prefill", 16, 16),
        ("prefill", 16, 32),
        ("prefill", 16, 64),
        ("select",),
        ("decode", 32),
        ("decode", 64),
    ]
    with count_compiles() as c:
        model.compile()
    assert c["backend"] == len(keys)
    with count_compiles() as c:
        model.compile()  # again: everything is already there
    assert c == {"backend": 0, "lowering": 0, "tracing": 0}
    rng = np.random.default_rng(0)
    with count_compiles() as c:
        for length, new in ((3, 5), (9, 40), (30, 20), (16, 1)):
            ids = rng.integers(0, 101, (2, length))
            model.sample(ids, max_new_tokens=new)
            model.sample(ids[:1], max_new_tokens=new, eos_token_id=[3, 4])
            # every sampling value, seed, eos list, stop sequence and output option is traced
            model.sample(
                ids,
                max_new_tokens=[new, max(1, new // 2)],
                do_sample=[True, False],
                temperature=0.7 + new / 100,
                top_k=[0, new],
                top_p=[0.9, 1.0],
                min_p=0.05,
                repetition_penalty=1.3,
                no_repeat_ngram_size=[2, 0],
                seed=[new, 7],
                eos_token_id=list(range(new % 5 + 1)),
                stop_sequences=[[5, 6], [int(ids[0, 0])]],
                return_dict=True,
                top_logprobs=3,
            )
        model.forward(rng.integers(0, 101, (1, 50)))
    assert c == {"backend": 0, "lowering": 0, "tracing": 0}


def test_lazy_compile_only_needed_graphs(gpt2_path):
    model = AutoModelForSampling.from_pretrained(
        gpt2_path, n_positions=[32, 64], context_length_estimate=[8, 16], compile_cache=False
    )
    with count_compiles() as c:
        model.sample(np.arange(1, 6)[None], max_new_tokens=4)
    # only prefill (8, 8), select and decode 32 (select may come from jax's in-process cache)
    assert {(r["graph"], *r["bucket"]) for r in model.compile_report} == {
        ("prefill", 8, 8),
        ("select",),
        ("decode", 32),
    }
    assert 2 <= c["backend"] <= 3
    with count_compiles() as c:
        model.sample(np.arange(1, 7)[None], max_new_tokens=3)
    assert c["backend"] == 0
