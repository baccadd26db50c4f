"""The sampler on its own, fed tensors: it draws from the distribution its settings describe,
never a token a cut removed, and a seeded row's draws depend on its own generator only."""

from __future__ import annotations

import torch

from pdserve.layers.sampler import Sampler, SamplingBatch, skip_draws

# p = .634 .233 .086 .032 .012 .004 at temperature 1
LOGITS = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0, -2.0])


def rows_batch(
    temperatures: list[float],
    generators: list[torch.Generator | None] | None = None,
    top_ks: list[int] | None = None,
    top_ps: list[float] | None = None,
    min_ps: list[float] | None = None,
) -> SamplingBatch:
    """A batch in which temperature 0 marks a greedy row."""
    temps = torch.tensor(temperatures)
    greedy = temps == 0
    return SamplingBatch(
        greedy=greedy,
        temperatures=torch.where(greedy, 1.0, temps),
        generators=generators or [None] * len(temperatures),
        top_ks=None if top_ks is None else torch.tensor(top_ks),
        top_ps=None if top_ps is None else torch.tensor(top_ps),
        min_ps=None if min_ps is None else torch.tensor(min_ps),
    )


def test_without_a_batch_every_row_takes_the_argmax():
    logits = torch.randn(64, 100, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(seed=0)
    state = sampler.generator.get_state()
    assert sampler(logits) == logits.argmax(dim=-1).tolist()
    assert torch.equal(sampler.generator.get_state(), state)  # no noise drawn for it


def test_a_tie_goes_to_the_first_largest_as_argmax_has_it():
    logits = torch.zeros(3, 49152)  # a row the width of a real vocabulary, split among threads
    logits[0, [7, 40000]] = 5.0
    logits[1, [30000, 30001]] = 2.0
    assert Sampler(seed=0)(logits) == [7, 30000, 0] == logits.argmax(dim=-1).tolist()


def test_greedy_rows_of_a_sampling_batch_take_the_argmax():
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(1))
    got = Sampler(seed=0)(logits, rows_batch([0.0, 1.0, 0.0, 2.0, 0.0, 0.5], top_ks=[0, 5, 0, 0, 0, 0]))
    assert [got[i] for i in (0, 2, 4)] == [int(logits[i].argmax()) for i in (0, 2, 4)]


def test_a_seeded_row_draws_the_same_tokens_whatever_its_batch_mates():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(2))

    def draws(sampler: Sampler, batch_logits: torch.Tensor, row: int, make_batch) -> list[int]:
        generator = torch.Generator().manual_seed(42)
        return [sampler(batch_logits, make_batch(generator))[row] for _ in range(8)]

    alone = draws(Sampler(seed=0), logits[2:3], 0, lambda gen: rows_batch([0.8], [gen], top_ps=[0.95]))
    # other settings, unseeded mates drawing from a differently seeded sampler, another seeded mate
    crowded = draws(Sampler(seed=1), logits, 2, lambda gen: rows_batch(
        [1.0, 0.0, 0.8, 1.5, 0.3], [None, None, gen, torch.Generator().manual_seed(7), None],
        top_ks=[3, 0, 0, 10, 0], top_ps=[1.0, 1.0, 0.95, 0.5, 1.0], min_ps=[0.0, 0.0, 0.0, 0.0, 0.2]))
    assert crowded == alone
    assert len(set(alone)) > 1  # it really samples


def test_skip_draws_leaves_a_generator_where_sampling_would():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(3))
    sampled, skipped = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    sampler = Sampler(seed=0)
    for _ in range(5):
        sampler(logits, rows_batch([0.7, 1.0, 0.0], [None, sampled, None], top_ps=[0.9, 0.9, 1.0]))
    skip_draws(skipped, vocab_size=40, num_tokens=5)
    assert torch.equal(sampled.get_state(), skipped.get_state())


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_the_exponential_race_draws_from_the_tempered_softmax():
    rows, temperature = 20_000, 1.7
    logits = torch.tensor([1.0, 0.5, 0.0, -0.3, -1.0, 0.8, 0.2, -0.6]).repeat(rows, 1)
    got = torch.tensor(Sampler(seed=0)(logits, rows_batch([temperature] * rows)))
    counts = torch.bincount(got, minlength=8).double()
    # chi-square with 7 degrees of freedom exceeds 24.32 with probability 0.001
    assert chi_square(counts, (logits[0] / temperature).softmax(-1).double()) < 24.32
    # the test can tell: the untempered softmax is rejected by far
    assert chi_square(counts, logits[0].softmax(-1).double()) > 200


def test_cuts_never_draw_a_cut_token_and_keep_all_the_others():
    cases = [  # (temperature, top_k, top_p, min_p) -> the tokens that may be drawn
        ((1.0, 3, 1.0, 0.0), {0, 1, 2}),
        ((1.0, 0, 0.8, 0.0), {0, 1}),  # mass before token 2: .87 >= .8
        ((1.0, 0, 0.9, 0.0), {0, 1, 2}),  # mass before token 3: .95 >= .9
        ((2.0, 0, 0.8, 0.0), {0, 1, 2}),  # hotter: .41 .25 .15 .09; mass before token 3: .82
        ((1.0, 0, 1.0, 0.1), {0, 1, 2}),  # .032 < .1 * .634
        ((1.0, 0, 1.0, 0.3), {0, 1}),  # .086 < .3 * .634 <= .233
        ((1.0, 4, 1.0, 0.1), {0, 1, 2}),  # top-k keeps 4, min-p cuts one of them
        ((1.0, 5, 0.8, 0.0), {0, 1}),
        ((1.0, 0, 1.0, 0.0), set(range(6))),
        ((1.0, 100, 1.0, 0.0), set(range(6))),  # k past the vocabulary: no cut
        ((0.0, 2, 0.5, 0.5), {0}),  # greedy: cuts do not matter
    ]
    per_case = 2000
    settings = [s for s, _ in cases for _ in range(per_case)]
    temperatures, top_ks, top_ps, min_ps = map(list, zip(*settings))
    batch = rows_batch(temperatures, top_ks=top_ks, top_ps=top_ps, min_ps=min_ps)
    got = Sampler(seed=0)(LOGITS.repeat(len(settings), 1), batch)
    for i, (setting, allowed) in enumerate(cases):
        assert set(got[i * per_case:(i + 1) * per_case]) == allowed, setting


def test_top_p_over_a_large_vocabulary_keeps_what_a_full_sort_keeps():
    """Over a 262k-word vocabulary the nucleus is sought among the most likely tokens first: the
    kept set equals the whole sort's, where it lies among them and where it does not (a flat row)."""
    from pdserve.layers import sampler

    g = torch.Generator().manual_seed(3)
    vocab = 262_144
    peaked = torch.randn(3, vocab, generator=g) * 4  # nuclei of a few hundred tokens at most
    flat = torch.randn(1, vocab, generator=g) * 0.01  # a nucleus of most of the vocabulary
    for logits in (peaked, torch.cat([peaked[:1], flat])):
        probs = logits.softmax(dim=-1)
        top_ps = torch.tensor([0.9, 0.5, 0.99, 0.7][: len(probs)])
        got = sampler._apply_top_p(probs, top_ps)
        values, order = probs.sort(dim=-1, descending=True)
        expected = sampler._nucleus(probs, values, order, top_ps, probs.sum(dim=-1, keepdim=True))
        assert torch.equal(got > 0, expected > 0) and torch.equal(got, expected)
