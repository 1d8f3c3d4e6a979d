"""Token layout: where this step's tokens go. Pure functions of the batch.

A step's batch is described per row (one row = one sequence's slice of tokens in this step)
by three things: ``cached_lens[r]`` (tokens of the row already in the KV pool), ``query_lens[r]``
(tokens computed this step) and ``block_tables[r]`` (pool blocks holding the row's pages).
Everything an attention backend needs follows from those (see ``StepLayout``).

Legend: B = rows, T = tokens this step (sum of query_lens), P = padded pages per row.
"""
