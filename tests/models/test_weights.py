"""Non-degenerate seeded weights: a norm that ignores its weight or a dropped bias is caught."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _support.runs import IN_ORDER

from pytest_modelpatch.errors import PatchUsageError
from pytest_modelpatch.families.catalog import tiny_config
from pytest_modelpatch.models.checkpoints import cached_checkpoint, load_pretrained, seeded_model
from pytest_modelpatch.models.weights import spread_weights


def test_norm_weights_and_biases_leave_transformers_defaults() -> None:
    bert = seeded_model(tiny_config("bert"))
    weight = bert.bert.encoder.layer[0].output.LayerNorm.weight.detach()
    bias = bert.bert.encoder.layer[0].output.dense.bias.detach()
    assert 0.5 <= float(weight.min()) and float(weight.max()) <= 1.5
    assert float((weight - 1).abs().min()) > 0 and float(weight.std()) > 0.1
    assert float(bias.abs().max()) <= 0.25 and float(bias.std()) > 0.05

    plain = seeded_model(tiny_config("bert"), init="transformers")
    assert torch.equal(plain.bert.encoder.layer[0].output.LayerNorm.weight, torch.ones(weight.shape))
    assert not plain.bert.encoder.layer[0].output.dense.bias.any()


def test_matrices_are_scaled_so_activations_stay_order_one() -> None:
    llama = seeded_model(tiny_config("llama"))
    q = llama.model.layers[0].self_attn.q_proj.weight.detach()
    assert abs(float(q.std()) * q.shape[-1] ** 0.5 - 1) < 1e-3  # std 1/sqrt(fan_in)
    with torch.no_grad():
        logits = llama(input_ids=torch.arange(8)[None]).logits
    assert 0.3 < float(logits.std()) < 3 and bool(torch.isfinite(logits).all())


def test_computed_buffers_such_as_rotary_inv_freq_stay_intact() -> None:
    config = tiny_config("llama")
    spread, plain = seeded_model(config), seeded_model(config, init="transformers")
    assert torch.equal(spread.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq)
    mamba = seeded_model(tiny_config("mamba"))
    reference = seeded_model(tiny_config("mamba"), init="transformers")
    # A_log is log(1..N): computed structure, not a default to spread
    assert torch.equal(mamba.backbone.layers[0].mixer.A_log, reference.backbone.layers[0].mixer.A_log)


def test_spread_is_deterministic_per_seed_and_leaves_the_global_rng_alone() -> None:
    config = tiny_config("llama")
    state = torch.random.get_rng_state()
    a, b, c = (spread_weights(seeded_model(config, init="transformers"), seed=s) for s in (1, 1, 2))
    assert torch.equal(torch.random.get_rng_state(), state)
    norm = "model.norm.weight"
    assert torch.equal(a.state_dict()[norm], b.state_dict()[norm])
    assert not torch.equal(a.state_dict()[norm], c.state_dict()[norm])


def test_the_init_scheme_is_part_of_the_cache_key_and_survives_save_and_load(tmp_path: Path) -> None:
    config = tiny_config("llama")
    spread = cached_checkpoint(config, cache_dir=tmp_path)
    plain = cached_checkpoint(config, cache_dir=tmp_path, init="transformers")
    assert spread != plain
    loaded = load_pretrained(spread).state_dict()
    assert torch.equal(loaded["model.norm.weight"], seeded_model(config).state_dict()["model.norm.weight"])
    assert torch.equal(load_pretrained(plain).state_dict()["model.norm.weight"], torch.ones(config.hidden_size))


def test_an_unknown_init_names_the_schemes() -> None:
    with pytest.raises(PatchUsageError, match=r"init='xavier' is not a weight scheme: use init='modelpatch'"):
        seeded_model(tiny_config("llama"), init="xavier")


# -- the bugs transformers' default init hides, caught in real pytest runs ------------

BUGS = """
import pytest
import torch
from torch import nn
from transformers.models.bert.modeling_bert import BertSelfOutput
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from pytest_modelpatch import assert_equivalent


class NormIgnoringWeight(LlamaRMSNorm):
    def forward(self, hidden_states):
        variance = hidden_states.float().pow(2).mean(-1, keepdim=True)
        return (hidden_states * torch.rsqrt(variance + self.variance_epsilon)).to(hidden_states.dtype)


class SelfOutputWithoutBias(BertSelfOutput):
    def forward(self, hidden_states, input_tensor):
        projected = nn.functional.linear(hidden_states, self.dense.weight)  # dense.bias dropped
        return self.LayerNorm(self.dropout(projected) + input_tensor)


@pytest.mark.model("llama"{init})
@pytest.mark.patch({{"LlamaRMSNorm": NormIgnoringWeight}})
def test_llama_norm(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("bert"{init})
@pytest.mark.patch({{"BertSelfOutput": SelfOutputWithoutBias}})
def test_bert_bias(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)
"""


def test_a_norm_ignoring_its_weight_and_a_dropped_bias_fail_on_the_default_tiny_models(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(BUGS.format(init=""))
    result = pytester.runpytest(*IN_ORDER)
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*patched LlamaForCausalLM differs from reference*", "*patched Bert* differs*"])


def test_init_transformers_opts_out_and_the_same_bugs_pass(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(BUGS.format(init=', init="transformers"'))
    pytester.runpytest(*IN_ORDER).assert_outcomes(passed=2)
