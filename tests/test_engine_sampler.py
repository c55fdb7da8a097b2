"""The sampler alone: distributions, filters, penalties, seeds and the two logprob modes."""

from __future__ import annotations

import torch

from tandem.rollout.engine.sampler import sample
from tandem.rollout.engine.sequence import Sequence
from tandem.types import SamplingParams

from float_bounds import U, assert_within, log_softmax_bound

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def seqs(count: int, tokens: list[int] | None = None, **params) -> list[Sequence]:
    out = []
    for _ in range(count):
        seq = Sequence("s", list(tokens or [0]), SamplingParams(**params), frozenset(), 100)
        if params.get("seed") is not None:
            seq.generator = torch.Generator().manual_seed(params["seed"])
        out.append(seq)
    return out


def frequencies(tokens: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=len(LOGITS)).float() / len(tokens)


def test_temperature_sampling_follows_softmax():
    count = 40_000
    generator = torch.Generator().manual_seed(0)
    for temperature in (1.0, 0.5):
        tokens, logprobs, *_ = sample(LOGITS.repeat(count, 1), seqs(count, temperature=temperature),
                                  "raw", generator)
        expected = (LOGITS / temperature).softmax(-1)
        assert (frequencies(tokens) - expected).abs().max() < 0.01
        # raw mode: the untempered model's log-probs, exact within the float32 log-softmax bound
        exact, bound = LOGITS.double().log_softmax(-1), log_softmax_bound(LOGITS)
        assert_within(torch.tensor(logprobs), exact[tokens], bound[tokens], "raw log-probs")


def test_top_k_and_top_p_restrict_the_support_and_renormalise():
    count = 20_000
    generator = torch.Generator().manual_seed(1)
    tokens, logprobs, *_ = sample(LOGITS.repeat(count, 1), seqs(count, top_k=2), "processed",
                              generator)
    assert set(tokens) == {0, 1}
    kept = LOGITS[:2].softmax(-1)
    assert (frequencies(tokens)[:2] - kept).abs().max() < 0.015
    top2 = torch.cat([LOGITS[:2], torch.full((len(LOGITS) - 2,), float("-inf"))])
    exact, bound = top2.double().log_softmax(-1), log_softmax_bound(top2)
    assert_within(torch.tensor(logprobs), exact[tokens], bound[tokens], "processed log-probs")
    probs = LOGITS.softmax(-1)  # 0.55, 0.20, 0.12, ...: top_p 0.7 keeps the first two
    tokens, *_ = sample(LOGITS.repeat(count, 1), seqs(count, top_p=0.7), "raw", generator)
    assert set(tokens) == {0, 1} and probs[:2].sum() > 0.7 > probs[0]


def test_greedy_and_mixed_batches():
    generator = torch.Generator().manual_seed(2)
    batch = seqs(3, temperature=0) + seqs(3, temperature=1.0)
    tokens, logprobs, *_ = sample(LOGITS.repeat(6, 1), batch, "raw", generator)
    assert tokens[:3] == [0, 0, 0]
    assert len(logprobs) == 6


def test_repetition_penalty_follows_hf():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    seen = [0, 3]
    generator = torch.Generator().manual_seed(3)
    tokens, logprobs, *_ = sample(LOGITS[None].clone(), seqs(1, seen, temperature=0,
                                                         repetition_penalty=5.0),
                              "processed", generator)
    expected = RepetitionPenaltyLogitsProcessor(5.0)(torch.tensor([seen]), LOGITS[None].double())[0]
    assert tokens == [int(expected.argmax())] == [1]
    # the penalty rounds each penalised logit once (u |z|), moving log p_1 by (e_1 - p) . dz
    exact = expected.log_softmax(-1)
    penalty = U * ((torch.nn.functional.one_hot(torch.tensor(1), len(LOGITS)) - exact.exp()).abs()
                   * expected.abs())[seen].sum()
    assert_within(torch.tensor(logprobs), exact[1:2], log_softmax_bound(expected)[1] + penalty,
                  "penalised log-prob")


def test_per_request_seed_is_independent_of_the_batch():
    generator = torch.Generator().manual_seed(4)
    alone_seq, crowd_seq = seqs(1, seed=7)[0], seqs(1, seed=7)[0]
    alone = [sample(LOGITS[None], [alone_seq], "raw", generator)[0][0] for _ in range(30)]
    crowd = [sample(LOGITS.repeat(5, 1), seqs(4) + [crowd_seq], "raw", generator)[0][-1]
             for _ in range(30)]
    assert crowd == alone and len(set(alone)) > 1
