"""A check the full-key selection tests share: wrap a sparse-resident engine's predictor so every decode step's
choice, at every layer and KV head, is checked against an independent score of that layer's keys."""

from __future__ import annotations


def check_sink_plus_top_k(llm, score, k: int) -> list[int]:
    """Spy on ``llm``'s predictor (sparse-resident, ``sink_blocks=1``, ``top_k_blocks=k``): each prediction must be
    block 0 plus the ``k - 1`` best other candidates of ``score(query, layer_keys, batch)`` (``[B][Hkv]`` lists of
    per-candidate scores, computed by the caller's own reference). Returns a one-item list counting the (step,
    layer, KV head) choices checked, which grows as the engine runs."""
    backend, checked = llm.engine.backend, [0]
    predictor = backend.predictor
    real = predictor.predict

    def spy(layer, query, batch, next_step, int32=False, **kw):
        ids = real(layer, query, batch, next_step, int32, **kw)
        for b, per_head in enumerate(score(query, backend.dev_cache.k[layer], batch)):
            for h, s in enumerate(per_head):
                rest = sorted(range(1, len(s)), key=lambda j: -s[j])[:k - 1]
                assert sorted(int(j) for j in ids[b, h] if j >= 0) == sorted([0] + rest)
                checked[0] += 1
        return ids

    predictor.predict = spy
    return checked
