"""float32 rounding-error bounds for the numeric tests (Higham, Accuracy and Stability of
Numerical Algorithms, ch. 3), so that tolerances follow from the sizes and the data, not from
one CPU's observed error.

u = 2**-24 is float32's unit roundoff; gamma(n) = n u / (1 - n u). A dot product of length n
computed in float32 in any order, with or without FMA, satisfies
|fl(x.y) - x.y| <= gamma(n) * sum_i |x_i y_i|. References are computed in float64 (their own
error, ~1e-16 relative, is neglected), so each bound is the float32 side's alone.
"""

from __future__ import annotations

import copy

import torch

U = 2.0 ** -24  # float32 unit roundoff
BF16_U = 2.0 ** -8  # bfloat16 unit roundoff (8 significand bits)
# exp_nonpositive (csrc/cpu_kernels.cpp): Horner of degree 7 on |r| <= ln2/2 is within
# gamma(14) * e^{2|r|} <= 28u of the series, the truncation is < 0.2u, the range reduction
# < 0.5u; torch's own exp is within a few ulp. 32u covers both.
EXP_RELATIVE = 32 * U


def gamma(n: int | torch.Tensor) -> float | torch.Tensor:
    """gamma_n = n u / (1 - n u): the relative error bound of n float32 operations."""
    return n * U / (1 - n * U)


def assert_within(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor | float,
                  what: str = "") -> None:
    """|actual - expected| <= bound element-wise (in float64); the message gives the worst
    ratio error / bound and where it is."""
    error = (actual.double() - expected.double()).abs()
    bound = torch.as_tensor(bound, dtype=torch.float64).expand_as(error)
    over = error > bound
    if bool(over.any()):
        ratio = error / bound.clamp(min=1e-300)
        worst = int(ratio.argmax())
        raise AssertionError(f"{what}: {int(over.sum())} of {error.numel()} elements exceed the "
                             f"float32 bound; worst at flat index {worst}: error "
                             f"{float(error.flatten()[worst]):.3e} > bound "
                             f"{float(bound.flatten()[worst]):.3e}")


def max_ratio(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor) -> float:
    """max |actual - expected| / bound: > 1 means the bound rejects `actual`."""
    return float(((actual.double() - expected.double()).abs() / bound).max())


def log_softmax_bound(logits: torch.Tensor) -> torch.Tensor:
    """Bound on float32 log_softmax(logits)[..., v] given exact logits [..., V] (-inf entries:
    masked out): x - m rounds (u), n exps (EXP_RELATIVE), their positive sum (gamma(n)), the
    log (u of the log-sum), the two subtractions (u of each result)."""
    logits = logits.double()
    count = torch.isfinite(logits).sum(-1, keepdim=True)
    top = logits.max(-1, keepdim=True).values
    shifted = logits - top
    log_sum = shifted.exp().sum(-1, keepdim=True).log()
    return (EXP_RELATIVE + gamma(count) + U * shifted.abs() * 2 + U * log_sum.abs() * 3
            + U * (shifted - log_sum).abs())


def token_logprob_bounds(model: torch.nn.Module, prompt: list[int], response: list[int],
                         temperature: float = 1.0, top_k: int = 0, unit: float = U,
                         image_rows: torch.Tensor | None = None,
                         position_ids: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact (float64) log-probabilities of `response` after `prompt` under an HF causal LM
    (of logits / temperature restricted to the top_k, if given), and for each a first-order
    bound on the error of any float32 forward of the same model; on the model's device.

    `unit` is the unit roundoff of the format activations are stored in: U (float32, the
    default) or BF16_U for a bfloat16 model whose kernels compute in float32 and round each
    result to bfloat16 (CUDA's and oneDNN's); see `_storage_terms` for what that adds.

    Running-error analysis through autograd: a rounding error e_z in an intermediate z moves a
    log-prob l by (dl/dz) e_z to first order, so |err l| <= sum_z |dl/dz| bound(e_z), with the
    local bound of each op from its exact inputs:
      linear y = W x + b (n inputs)      gamma(n + 1) (|W| |x| + |b|)
      RMSNorm of width H                 (gamma(H) / 2 + 6u) |z|
      residual add (each norm's input)   u |z|
      silu(gate) * up (down_proj input)  (EXP_RELATIVE + 5u) |z|
      attention core (o_proj input)      (2 eta + 2 gamma(L) + 3u) max_j |v_j|, eta the score
          bound of the kernel test, with sum_d |q_d k_d| <= ||q|| ||k||, 6 extra roundings
          for the rotary embedding and room for a softmax merged from two parts
      temperature division, log-softmax  u |z / T|, log_softmax_bound
    The second-order terms (products of two such errors) are at most the intermediates'
    relative error times the first-order ones: ~1e-6 in float32, covered by a factor 1.01; in
    bfloat16 up to ~0.3 (a few 2**-8 roundings per layer through 24 layers), covered by 2.
    A float32 implementation's error is within the bound whatever its summation order.

    A vision-language model (Qwen2-VL): `image_rows` are the vision tower's float32 embeddings
    of the image tokens, in order, taken as exact inputs (both sides compute them with the same
    call, bit for bit), and `position_ids` the sequence's [3, L] rotary positions; the bound is
    the language model's.
    """
    exact = copy.deepcopy(model).double().eval()
    device = next(exact.parameters()).device
    for parameter in exact.parameters():
        parameter.requires_grad_(False)
    records: list[tuple[str, torch.nn.Module, torch.Tensor, torch.Tensor]] = []

    def keep(kind):
        def hook(module, inputs, output):
            records.append((kind, module, inputs[0], output))
        return hook

    handles = []
    for module in exact.modules():
        if isinstance(module, torch.nn.Linear):
            handles.append(module.register_forward_hook(keep("linear")))
        elif type(module).__name__.endswith("RMSNorm"):
            handles.append(module.register_forward_hook(keep("norm")))
    embeddings = exact.get_input_embeddings()
    ids = torch.tensor([prompt + response], device=device)
    inputs = embeddings(ids).detach()
    extra = {}
    if image_rows is not None:  # the first image tokens (a sampled one later is plain text)
        image = torch.zeros_like(ids, dtype=torch.bool)
        image[0, (ids[0] == model.config.image_token_id).nonzero()[:len(image_rows), 0]] = True
        inputs = inputs.masked_scatter(image[..., None], image_rows.double().to(device))
        extra["position_ids"] = position_ids[:, None].to(device)
    inputs = inputs.requires_grad_(True)
    try:
        logits = exact(inputs_embeds=inputs, **extra).logits[0, len(prompt) - 1:-1] / temperature
    finally:
        for handle in handles:
            handle.remove()
    processed = logits
    if top_k:
        processed = logits.masked_fill(logits < logits.topk(top_k).values[:, -1:], float("-inf"))
    chosen = torch.tensor(response, device=device)[:, None]
    picked = processed.log_softmax(-1).gather(-1, chosen)[:, 0]
    final = log_softmax_bound(processed.detach()).gather(-1, chosen)[:, 0]
    local = _local_error_bounds(exact, records, unit)
    # every token's gradients in one batched backward: row k of each is d picked[k] / d tensor
    weighed = [tensor for tensor, _ in local] + [logits]
    rows = torch.eye(len(response), dtype=torch.float64, device=device)
    grads = torch.autograd.grad(picked, weighed, grad_outputs=rows, is_grads_batched=True)
    total = final.clone()
    for grad, (_, bound) in zip(grads, local):
        total += (grad.abs() * bound).flatten(1).sum(1)
    if temperature != 1.0:
        total += U * (grads[-1].abs() * logits.detach().abs()).flatten(1).sum(1)
    second_order = 1.01 if unit == U else 2.0
    return picked.detach(), second_order * total.detach()


def _storage_terms(unit: float) -> tuple[float, float]:
    """(store, split) for activations stored with unit roundoff `unit` but computed in float32:
    `store` is the one extra rounding of each result to the narrower format (0 in float32, where
    the computation's own last rounding is the result); `split` allows for bfloat16 matrix
    products that add their split-K partial sums in bfloat16 (torch's default
    allow_bf16_reduced_precision_reduction), two more roundings of at most sum |w x|."""
    if unit == U:
        return 0.0, 0.0
    return unit, 2 * unit


def _local_error_bounds(model, records, unit: float = U) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tensor whose gradient weighs it, local rounding-error bound of that tensor); `unit`
    as in token_logprob_bounds. With a narrower storage format each op adds its result's
    rounding (`store`): linear outputs one (+ `split`), RMSNorm two (the cast back and the
    weight product), a residual sum its own unit, silu * up two, the rotary embedding up to
    5 sqrt(2) of |q| and |k| each (bf16 cos/sin, two products, a sum) and a materialised score
    two (score and scale) in the attention's score bound, and the attention core two of
    max |v| (the probabilities cast to bf16 before P V, the output cast)."""
    store, split = _storage_terms(unit)
    config = model.config.get_text_config()
    decoder = getattr(model.model, "language_model", model.model)  # a VLM's language model
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    outputs = {id(module): y for kind, module, x, y in records}
    local = []
    for kind, module, x, y in records:
        if kind == "norm":
            local.append((y, (gamma(y.shape[-1]) / 2 + 6 * U + 2 * store) * y.detach().abs()))
            if x.grad_fn is not None:  # a residual sum (not the embeddings, exact)
                local.append((x, max(unit, U) * x.detach().abs()))
            continue
        bias = module.bias.abs() if module.bias is not None else 0.0
        local.append((y, (gamma(module.in_features + 1) + store + split)
                      * (x.detach().abs() @ module.weight.abs().T + bias)))
    for layer in decoder.layers:
        attention, mlp = layer.self_attn, layer.mlp
        down_input = next(x for kind, module, x, y in records if module is mlp.down_proj)
        local.append((down_input, (EXP_RELATIVE + 5 * U + 2 * store) * down_input.detach().abs()))
        o_input = next(x for kind, module, x, y in records if module is attention.o_proj)
        q = outputs[id(getattr(attention, "q_norm", None))] if hasattr(attention, "q_norm") \
            else outputs[id(attention.q_proj)]
        k = outputs[id(getattr(attention, "k_norm", None))] if hasattr(attention, "k_norm") \
            else outputs[id(attention.k_proj)]
        v = outputs[id(attention.v_proj)]
        tokens = q.shape[1]
        q_norms = q.detach().reshape(tokens, heads, head_dim).norm(dim=-1)  # [T, H]
        k_norms = k.detach().reshape(tokens, kv_heads, head_dim).norm(dim=-1)
        v_abs = v.detach().reshape(tokens, kv_heads, head_dim).abs()
        group = heads // kv_heads
        # causal: token t sees 0..t; bound with the running max over those
        k_max = k_norms.cummax(0).values.repeat_interleave(group, 1)  # [T, H]
        v_max = v_abs.cummax(0).values.repeat_interleave(group, 1)  # [T, H, D]
        scale = getattr(attention, "scaling", head_dim ** -0.5)
        magnitude = scale * q_norms * k_max
        # + 2 EXP_RELATIVE + 4u: a softmax split in two parts merged by their log-sum-exps
        # (cascade attention over a shared prefix) rescales each part once
        eta = gamma(head_dim + 8) * magnitude + U * 2 * magnitude + 3 * EXP_RELATIVE + 4 * U
        eta = eta + (2 * 5 * 2 ** 0.5 + 2) * store * magnitude  # rotary of q and k, the score
        lengths = torch.arange(1, tokens + 1, dtype=torch.float64, device=v.device)[:, None, None]
        bound = (2 * eta[..., None] + 2 * gamma(lengths) + 3 * U + 2 * store) * v_max
        local.append((o_input, bound.reshape(1, tokens, heads * head_dim)))
    return local
