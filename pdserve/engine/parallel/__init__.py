"""Tensor parallelism inside a worker: the model's weights split across N ranks, each a process
with its share of every layer (attention heads and their KV, MLP columns, the vocabulary), which
add their partial results after each layer's attention and MLP and gather the logits.

Rank 0 is the worker: it schedules, samples and serves; ranks 1..N-1 (`follower`) are processes it
starts, which build their shard of the same checkpoint and then do what rank 0 tells them, step by
step (`group.RankGroup`). They die with it: to its supervisor, router and peers the N ranks are
one worker. `models/shard.py` says which slice of each weight a rank holds.
"""
