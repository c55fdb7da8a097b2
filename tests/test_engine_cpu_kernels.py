"""The fused CPU kernels (csrc/cpu_kernels.cpp) against torch / HF references,
and the engine's fused path against its torch path."""

from __future__ import annotations

import asyncio
import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm, apply_rotary_pos_emb

import tandem.rollout.engine.model_runner as model_runner
from tandem.config.schema import RolloutConfig
from tandem.models import TinyModelSpec, build_tiny_model
from tandem import cpu_kernels
from tandem.rollout.native import NativeRollout

from float_bounds import EXP_RELATIVE, U, assert_within, gamma, max_ratio, token_logprob_bounds
from tandem.types import GenerateRequest


@pytest.fixture(scope="module")
def ops():
    if os.environ.get(cpu_kernels.ENV_SWITCH) == "0":
        pytest.skip(f"{cpu_kernels.ENV_SWITCH}=0: the engine runs its torch path")
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler: the engine runs its torch path (logged)")
    loaded = cpu_kernels.load()
    assert loaded is not None, cpu_kernels.unavailable_reason()
    return loaded


def reference_attention(query, key_cache, value_cache, tables, lengths, scale):
    """Softmax attention per sequence over its gathered blocks (K/V repeated per group), in
    float64, and the float32 error bound of any kernel computing it -> (out, bound) [B, H, D].

    With S_j = scale * sum_d |q_d k_jd| (length D), the float32 scores are off by at most
    gamma(D + 2) S_j (the +2: rounding scale and q * scale); x_j = s_j - max rounds by
    u |s_j - max| and exp adds EXP_RELATIVE. Perturbing logit j by eta_j moves the output by
    sum_j p_j eta_j (v_j - o) to first order (the common part of eta cancels), so
    |err_d| <= sum_j p_j eta_j |v_jd - o_d| + (2 gamma(L) + 3u) sum_j p_j |v_jd|: the value sum
    and the normaliser are length-L sums of positive weights, then 1/sum and the product.
    The factor 1.01 covers the second-order terms (eta <= 1e-3 here).
    """
    kv_heads, _, block, dim = key_cache.shape
    group = query.shape[1] // kv_heads
    outs, bounds = [], []
    for b, (table, length) in enumerate(zip(tables, lengths)):
        keys = key_cache[:, table].reshape(kv_heads, -1, dim)[:, :length].double()
        values = value_cache[:, table].reshape(kv_heads, -1, dim)[:, :length].double()
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
        q = query[b].double()[:, None]  # [H, 1, D]
        scores = (q @ keys.transpose(1, 2))[:, 0] * scale  # [H, L]
        magnitude = (q.abs() @ keys.abs().transpose(1, 2))[:, 0] * scale
        weights = scores.softmax(-1)
        out = (weights[:, None] @ values)[:, 0]  # [H, D]
        eta = (gamma(dim + 2) * magnitude + U * (scores.max(-1, keepdim=True).values - scores)
               + EXP_RELATIVE)
        spread = (values - out[:, None]).abs()  # [H, L, D]
        bound = 1.01 * (weights * eta)[:, None] @ spread + \
            (2 * gamma(length) + 3 * U) * (weights[:, None] @ values.abs())
        outs.append(out)
        bounds.append(bound[:, 0])
    return torch.stack(outs), torch.stack(bounds)


def attention_case(dim, heads, kv_heads):
    """Random caches, five sequences around block edges, a scaled query; tables padded."""
    torch.manual_seed(dim)
    block, num_blocks = 16, 40
    key_cache = torch.randn(kv_heads, num_blocks, block, dim)
    value_cache = torch.randn(kv_heads, num_blocks, block, dim)
    lengths = [1, block - 1, block, block + 1, 5 * block + 7]
    tables = [torch.randperm(num_blocks)[:-(-n // block)].tolist() for n in lengths]
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    query = torch.randn(len(lengths), heads, dim) * 3
    return query, key_cache, value_cache, tables, padded, lengths, dim ** -0.5


@pytest.mark.parametrize("dim,heads,kv_heads", [(16, 4, 2), (64, 14, 2), (128, 8, 8), (80, 8, 1),
                                               (256, 4, 2), (16, 64, 1)])
def test_decode_attention_matches_softmax_attention(ops, dim, heads, kv_heads):
    query, key_cache, value_cache, tables, padded, lengths, scale = attention_case(dim, heads, kv_heads)
    out = torch.full_like(query, float("nan"))
    ops.decode_attention(out, query, key_cache, value_cache, padded, torch.tensor(lengths), scale)
    expected, bound = reference_attention(query, key_cache, value_cache, tables, lengths, scale)
    assert_within(out, expected, bound, f"decode_attention dim {dim}")


@pytest.mark.parametrize("dim", [16, 256])
def test_the_attention_bound_rejects_an_off_by_one_and_a_wrong_scale(dim):
    """The bound is loose enough for any float32 order, tight enough for real bugs: attending
    to one token too few, or a scale off by 1% (or 1/D for 1/sqrt(D)), exceeds it."""
    query, key_cache, value_cache, tables, _, lengths, scale = attention_case(dim, 4, 2)
    expected, bound = reference_attention(query, key_cache, value_cache, tables, lengths, scale)
    longer = lengths[1:]  # the sequences with more than one token: drop their last one
    short, _ = reference_attention(query[1:], key_cache, value_cache, tables[1:],
                                   [n - 1 for n in longer], scale)
    assert max_ratio(short, expected[1:], bound[1:]) > 10
    for wrong in (scale * 1.01, 1 / dim):
        mis_scaled, _ = reference_attention(query, key_cache, value_cache, tables, lengths, wrong)
        # every sequence longer than one token (one token: softmax of one is 1 whatever the scale)
        for b in range(1, len(lengths)):
            assert max_ratio(mis_scaled[b], expected[b], bound[b]) > 10


def test_decode_attention_rejects_bad_metadata(ops):
    key_cache = torch.zeros(2, 4, 16, 64)
    query, out = torch.zeros(1, 4, 64), torch.zeros(1, 4, 64)

    def call(tables, lengths, q=query, o=out):
        ops.decode_attention(o, q, key_cache, key_cache, torch.tensor(tables),
                             torch.tensor(lengths), 1.0)

    with pytest.raises(RuntimeError, match=r"context_lens\[0\] = 17 outside \[1, 16\]"):
        call([[0]], [17])
    with pytest.raises(RuntimeError, match="block id 4 outside the cache"):
        call([[4]], [3])
    with pytest.raises(RuntimeError, match="must be int64"):
        ops.decode_attention(out, query, key_cache, key_cache, torch.tensor([[0]], dtype=torch.int32),
                             torch.tensor([3]), 1.0)
    odd = torch.zeros(2, 4, 16, 48)
    with pytest.raises(RuntimeError, match="head_dim 48 is not compiled"):
        ops.decode_attention(torch.zeros(1, 4, 48), torch.zeros(1, 4, 48), odd, odd,
                             torch.tensor([[0]]), torch.tensor([3]), 1.0)


def rms_norm_reference(x, weight, eps):
    """w * x / sqrt(mean(x^2) + eps) in float64, and the float32 bound, relative per element:
    the sum of H squares (positive terms) is within gamma(H); the mean, + eps, sqrt (halving
    the relative error) and 1/. add 4u; x * inv and w * () add 2u: gamma(H) / 2 + 6u."""
    x64 = x.double()
    out = weight.double() * x64 / (x64.square().mean(-1, keepdim=True) + eps).sqrt()
    return out, (gamma(x.shape[-1]) / 2 + 6 * U) * out.abs()


@pytest.mark.parametrize("rows", [37, 1500])  # 1500 x 96: split across threads
def test_rms_norm_and_fused_residual_add_match_hf(ops, rows):
    torch.manual_seed(0)
    norm = Qwen2RMSNorm(96, eps=1e-6)
    norm.weight.data.normal_()
    x, residual = torch.randn(rows, 96) * 4, torch.randn(rows, 96)
    with torch.no_grad():
        assert_within(ops.rms_norm(x, norm.weight, 1e-6), *rms_norm_reference(x, norm.weight, 1e-6),
                      "rms_norm")
        expected_residual = residual + x  # one IEEE rounding of the same sum: bit-exact
        out = ops.add_rms_norm_(residual, x, norm.weight, 1e-6)
        torch.testing.assert_close(residual, expected_residual, atol=0, rtol=0)  # in place
        assert_within(out, *rms_norm_reference(expected_residual, norm.weight, 1e-6), "add_rms_norm_")
        # tight enough to see a mean over H - 1 (every output off by 1 - sqrt(95/96))
        expected, bound = rms_norm_reference(x, norm.weight, 1e-6)
        assert max_ratio(expected * (95 / 96) ** 0.5, expected, bound) > 10


def test_rotary_write_kv_matches_hf_and_writes_only_the_slots(ops):
    torch.manual_seed(0)
    tokens, heads, kv_heads, dim, block = 5, 4, 2, 32, 4
    positions = torch.tensor([0, 3, 4, 17, 100])
    slots = torch.tensor([0, 5, 6, 13, 30])
    angles = positions[:, None].float() * torch.rand(dim // 2)[None]
    table = torch.zeros(128, dim // 2)
    table[positions] = angles
    cos, sin = table.cos().repeat(1, 2).contiguous(), table.sin().repeat(1, 2).contiguous()
    q, k, v = torch.randn(tokens, heads, dim), torch.randn(tokens, kv_heads, dim), \
        torch.randn(tokens, kv_heads, dim)

    def reference(x):
        """HF's rotation (its [batch, heads, seq, dim] layout, tokens as the sequence) in
        float64 on the same float32 tables; each output is x_i c_i -/+ x_j s_i, two products
        and one sum: within gamma(2) (|x_i c_i| + |x_j s_i|)."""
        x = x.transpose(0, 1)[None].double()
        c, s = cos[positions][None].double(), sin[positions][None].double()
        out, _ = apply_rotary_pos_emb(x, x, c, s)
        partner = x.roll(dim // 2, -1)  # x_j: the other half, as rotate_half pairs them
        magnitude = x.abs() * c.abs()[:, None] + partner.abs() * s.abs()[:, None]
        return out[0].transpose(0, 1), gamma(2) * magnitude[0].transpose(0, 1)

    q_expected, q_bound = reference(q)
    k_expected, k_bound = reference(k)
    key_cache = torch.full((kv_heads, 8, block, dim), 7.0)
    value_cache = torch.full((kv_heads, 8, block, dim), 7.0)
    ops.rotary_write_kv(q, k, v, cos, sin, positions, slots, key_cache, value_cache)
    assert_within(q, q_expected, q_bound, "rotated q")
    flat_keys = key_cache.view(kv_heads, -1, dim)
    flat_values = value_cache.view(kv_heads, -1, dim)
    assert_within(flat_keys[:, slots].transpose(0, 1), k_expected, k_bound, "rotated k")
    assert torch.equal(flat_values[:, slots], v.transpose(0, 1))
    untouched = torch.ones(flat_keys.shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert flat_keys[:, untouched].eq(7).all() and flat_values[:, untouched].eq(7).all()
    with pytest.raises(RuntimeError, match="slot 32 outside the cache"):
        ops.rotary_write_kv(q, k, v, cos, sin, positions, slots + 2, key_cache, value_cache)


@pytest.mark.parametrize("size", [3000, 100_000])  # 100k: split across threads
def test_silu_and_mul_matches_torch_without_overflow(ops, size):
    gate = torch.cat([torch.randn(size) * 5, torch.tensor([0.0, -100.0, 100.0, -1e30, 1e30])])
    up = torch.randn_like(gate)
    out = ops.silu_and_mul(gate.view(-1, 5), up.view(-1, 5))
    assert torch.isfinite(out).all()
    expected = torch.nn.functional.silu(gate.double()) * up.double()
    # e = exp(-|x|) within EXP_RELATIVE moves sigmoid by at most as much (relative); 1 + e,
    # the division, x * sigmoid and * up add 4u. Below e^-87 (2^-125.5) e flushes to 0: an
    # absolute |x up| 2^-125 on top.
    bound = (EXP_RELATIVE + 4 * U) * expected.abs() + (gate.double() * up.double()).abs() * 2.0 ** -125
    assert_within(out.view(-1), expected, bound, "silu_and_mul")


def word_sum(data: bytes) -> int:
    """The slot checksum by its definition: little-endian 64-bit words (the tail zero-padded),
    summed with wraparound, as a signed int64."""
    padded = data + bytes(-len(data) % 8)
    total = sum(int.from_bytes(padded[i:i + 8], "little") for i in range(0, len(padded), 8))
    return (total + 2**63) % 2**64 - 2**63


# 0 to 13 bytes: no word / a tail only; 2^18 + 13: streaming stores (aligned destination) and a
# tail; 2^21 + 5: several 1 MiB pieces summed on different threads
@pytest.mark.parametrize("size", [0, 5, 8, 13, (1 << 18) + 13, (1 << 21) + 5])
@pytest.mark.parametrize("offset", [0, 3])  # 3: an unaligned destination, plain stores
def test_copy_and_sum_copies_the_bytes_and_sums_them_as_words(ops, size, offset):
    source = torch.randint(0, 256, (size,), dtype=torch.uint8)
    destination = torch.zeros(size + offset, dtype=torch.uint8)[offset:]
    expected = word_sum(bytes(source.tolist()))
    assert ops.copy_and_sum(destination, source) == expected
    assert torch.equal(destination, source)
    assert ops.sum_words(source) == expected

def test_switch_off_is_reported():

    saved = os.environ.get(cpu_kernels.ENV_SWITCH)
    os.environ[cpu_kernels.ENV_SWITCH] = "0"
    try:
        assert cpu_kernels._build() == (None, "TANDEM_CPU_KERNELS=0")
    finally:
        if saved is None:
            del os.environ[cpu_kernels.ENV_SWITCH]
        else:
            os.environ[cpu_kernels.ENV_SWITCH] = saved


def workload_prompt(index: int) -> list[int]:
    return list(range(40, 59)) + [100 + index] * (3 + 5 * (index % 3))


async def _run_workload(model_path) -> tuple[NativeRollout, list]:
    """Shared prefixes, staggered arrivals, chunked prompts, seeded sampling and greedy."""
    rollout = NativeRollout.create(model_path, RolloutConfig(
        kv_cache_memory_bytes=8 << 20, block_size=4, max_num_batched_tokens=48))

    async def one(index: int):
        await asyncio.sleep(0.002 * index)
        prompt = workload_prompt(index)
        params = {"temperature": 0 if index % 2 else 1.0, "seed": index, "max_tokens": 12 + index,
                  "ignore_eos": True}
        return await rollout.generate(GenerateRequest(f"r{index}", prompt, params))

    return rollout, await asyncio.gather(*(one(i) for i in range(10)))


def tiny_qwen3(directory) -> str:
    """A random Qwen3 (q/k norms, untied lm_head, head_dim 32 != hidden / heads) with the tiny
    models' tokenizer."""
    import shutil

    from transformers import Qwen3Config, Qwen3ForCausalLM

    shutil.copytree(build_tiny_model(TinyModelSpec()), directory)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=712, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
        max_position_embeddings=512))
    for parameter in model.parameters():
        parameter.data.normal_(0, 0.3)
    model.save_pretrained(directory)
    return str(directory)


@pytest.mark.parametrize("architecture", ["qwen2", "llama", "qwen3"])
async def test_fused_path_matches_torch_path(ops, architecture, monkeypatch, tmp_path):
    path = (tiny_qwen3(tmp_path / "qwen3") if architecture == "qwen3"
            else build_tiny_model(TinyModelSpec(architecture=architecture)))
    fused_rollout, fused = await _run_workload(path)
    assert fused_rollout.runner.kernels is not None
    monkeypatch.setattr(model_runner.cpu_kernels, "load", lambda: None)
    torch_rollout, plain = await _run_workload(path)
    assert torch_rollout.runner.kernels is None
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for index, (a, b) in enumerate(zip(fused, plain)):
        assert a.token_ids == b.token_ids
        # both within the float32 bound of the exact log-probs, so within twice it of each other
        exact, bound = token_logprob_bounds(hf, workload_prompt(index), a.token_ids)
        assert_within(torch.tensor(a.log_probs), exact, bound, "fused path")
        assert_within(torch.tensor(a.log_probs), torch.tensor(b.log_probs), 2 * bound, "fused vs torch")


def test_unsupported_head_size_takes_the_torch_path(ops):
    # hidden 96 / 2 heads: head_dim 48, not a compiled size
    path = build_tiny_model(TinyModelSpec(hidden_size=96, num_attention_heads=2,
                                          num_key_value_heads=1))
    rollout = NativeRollout.create(path, RolloutConfig(kv_cache_memory_bytes=8 << 20))
    assert rollout.runner.kernels is None
    out = asyncio.run(rollout.generate(GenerateRequest("a", [5, 6, 7], {"temperature": 0, "max_tokens": 4})))
    assert len(out.token_ids) == 4


def test_a_stale_build_lock_is_removed_and_a_hung_build_is_given_up(tmp_path, monkeypatch):
    import time

    calls = []
    monkeypatch.setattr(cpu_kernels, "_compile", lambda build_dir: calls.append(
        (build_dir / "lock").exists()) or (None, "compiled"))
    lock = tmp_path / "lock"
    lock.write_text("")
    old = time.time() - cpu_kernels.STALE_LOCK_S - 10
    os.utime(lock, (old, old))
    assert cpu_kernels._build_in(tmp_path) == (None, "compiled")
    assert calls == [False]  # the dead build's lock was gone before compiling
    lock.write_text("")  # a live build's lock is left alone
    cpu_kernels._build_in(tmp_path)
    assert calls == [False, True]

    monkeypatch.setattr(cpu_kernels, "BUILD_TIMEOUT_S", 0.05)
    monkeypatch.setattr(cpu_kernels, "_compile", lambda build_dir: time.sleep(1) or (None, ""))
    ops, reason = cpu_kernels._build_in(tmp_path)
    assert ops is None and "took over" in reason


def test_the_build_compiles_a_copy_inside_its_folder(tmp_path, monkeypatch):
    """The compiled path is the same for every checkout, so checkouts at different paths share
    one build instead of rebuilding it in turn (ninja reruns when its command changes)."""
    from torch.utils import cpp_extension

    sources = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: sources.append(kwargs["sources"]))
    assert cpu_kernels._compile(tmp_path)[1] is None
    assert sources == [[str(tmp_path / cpu_kernels.SOURCE.name)]]
    assert (tmp_path / cpu_kernels.SOURCE.name).read_bytes() == cpu_kernels.SOURCE.read_bytes()
    assert (tmp_path / cpu_kernels.READY).exists()


def test_a_finished_build_loads_without_the_builder(ops, monkeypatch):
    build_dir = cpu_kernels.build_directory()
    assert (build_dir / cpu_kernels.READY).exists()  # written by the build `ops` loaded
    monkeypatch.setattr(cpu_kernels, "_compile", lambda build_dir: pytest.fail("compiled again"))
    assert cpu_kernels._build_in(build_dir) == (torch.ops.tandem_cpu, None)
