"""`DecodeGraph`: a model's decode step planned whole on the host, its launches (the model's and every layer's)
run as one piece, then taken on the host; on CUDA that piece is a graph's replay.

On the CPU no graph is captured, and what is checked is what a replay relies on: a step taken apart equals the
ordinary step bit for bit and leaves the cache as the ordinary step would (its counters, its later steps);
planning changes nothing when the step then runs the ordinary way; the launches of two steps with one key are
the same, with the same arguments at the same addresses, and change no host state; a failure among them breaks
the cache. What a replay gives is held on the GPU (`tests/cuda/test_cuda_cache.py`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvtier import DecodeGraph, TieredCache, cache_kwargs
from kvtier.engine.graphs import StepGraphs
from kvtier.errors import BrokenCacheError, CapacityError, ConfigError, UnsupportedError

from tiny_models import random_kvp, tiny_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))


def _cache(model, **kw) -> TieredCache:
    kw = {"device_budget": 48, "recall_pages": 2, "prefetch_pages": 2, **kw}
    return TieredCache(model.config, **kw).take_gpu_path()


def _prompt(n=200, seed=3):
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _decode(step, steps=60, prompt=None):
    logits = step(_prompt() if prompt is None else prompt)[:, -1:]
    out = []
    for _ in range(steps):
        logits = step(logits.argmax(-1))[:, -1:].clone()
        out.append(logits)
    return torch.cat(out)


def _plain(model, cache):
    return lambda t: model(t, **cache_kwargs(cache)).logits


def _same_stats(a: dict, b: dict) -> None:
    a, b = dict(a), dict(b)
    for name in ("cuda_graphs", "transfer_wait_seconds"):   # the layers' own graphs' counts; a time
        a.pop(name), b.pop(name)
    assert a == b


@pytest.mark.parametrize("scorer", ["keynorm", "kvp"])
def test_steps_taken_apart_equal_ordinary_ones(scorer):
    """Decoding through `DecodeGraph` (steps planned whole where steady, the others the ordinary way) gives the
    logits of ordinary steps, bit for bit, and the same counters (pages recalled, prefetched, reused, demoted)."""
    model = tiny_llama()
    kind = scorer if scorer == "keynorm" else random_kvp(model)
    runs = {}
    for graphed in (False, True):
        with _cache(model, scorer=kind) as cache:
            step = DecodeGraph(model, cache) if graphed else _plain(model, cache)
            runs[graphed] = (_decode(step), cache.stats(), step.stats() if graphed else None)
    assert torch.equal(runs[True][0], runs[False][0])
    _same_stats(runs[True][1], runs[False][1])
    s = runs[True][2]
    assert runs[True][1]["demotions"] > 0 and runs[True][1]["prefetch"]["pages"] > 0
    # every step but the prompt and the first decode step (which says what the next ones look like) was planned
    # whole, those that demote included (launched eagerly: no graph on a CPU)
    assert s["ordinary"] == 2 and s["eager"] == 59 and s["replays"] == s["captures"] == 0, s
    assert s["failed"] is None


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_a_planned_step_hands_the_model_a_mask_it_takes_as_it_is(implementation, monkeypatch):
    """Where every layer attends through kvtier, a planned step gives the model a ready 4D mask, so transformers
    builds none (it would inside a capture only, and on 5.17 an eager mask through a pageable host copy); the
    ordinary steps (the prompt, the first decode step) get none, and the logits are the ordinary steps'."""
    import transformers.masking_utils as masking

    model = tiny_llama()
    model.config._attn_implementation = implementation
    built = []
    made = masking.create_causal_mask

    def counting(*args, **kwargs):
        mask = kwargs.get("attention_mask")
        built.append(isinstance(mask, torch.Tensor) and mask.dim() == 4)
        return made(*args, **kwargs)

    runs = {}
    for graphed in (False, True):
        with _cache(model) as cache:
            step = DecodeGraph(model, cache) if graphed else _plain(model, cache)
            built.clear()
            if graphed:
                import transformers.models.llama.modeling_llama as llama

                monkeypatch.setattr(llama, "create_causal_mask", counting)
            runs[graphed] = _decode(step, steps=20)
    assert torch.equal(runs[True], runs[False])
    assert built[:2] == [False, False] and all(built[2:]) and len(built) == 21, built


def test_steps_through_it_and_ordinary_ones_mix():
    """Steps through `DecodeGraph` and ordinary calls of the model may alternate: the cache is left as the
    ordinary steps leave it, so the same logits come either way."""
    model = tiny_llama()
    with _cache(model) as cache:
        want = _decode(_plain(model, cache))
    with _cache(model) as cache:
        graph, plain = DecodeGraph(model, cache), _plain(model, cache)
        calls = iter([graph, plain, plain, graph, graph, graph] * 20)
        got = _decode(lambda t: next(calls)(t))
    assert torch.equal(got, want)


def test_planning_a_step_that_then_runs_the_ordinary_way_changes_nothing():
    """Where some layer's step is not steady, the others' plans are let go and the step runs the ordinary way:
    what planning made (the step's position, the recall buffer, the count's place on the device) the ordinary step
    makes alike, so nothing differs."""
    model = tiny_llama()
    with _cache(model) as cache:
        want = _decode(_plain(model, cache))
    with _cache(model) as cache:
        graph, plain = DecodeGraph(model, cache), _plain(model, cache)

        def planned_then_plain(t):
            if t.shape[1] == 1:
                graph._plan()
            return plain(t)

        got = _decode(planned_then_plain)
    assert torch.equal(got, want)


def test_keys_repeat_between_demotions():
    """The key of a planned step (every layer's, the model's weights, the inputs' shapes) is the same from one
    steady step to the next, so a graph captured once is replayed, and differs after a demotion."""
    model = tiny_llama()
    keys = []
    with _cache(model) as cache:
        graph = DecodeGraph(model, cache)
        run = graph.graphs.run

        def keyed(key, inputs, work, **kwargs):
            keys.append((cache.stats()["demotions"], key()))
            return run(key, inputs, work, **kwargs)

        graph.graphs.run = keyed
        _decode(graph)
    same = sum(a[1] == b[1] for a, b in zip(keys, keys[1:]))
    changed = sum(a[1] != b[1] for a, b in zip(keys, keys[1:]))
    assert same >= 3 * changed and changed >= 1, (same, changed)
    # a key that repeats did so within one demotion count
    assert all(a[0] == b[0] for a, b in zip(keys, keys[1:]) if a[1] == b[1])


def test_a_planned_step_issues_the_same_launches_under_one_key(monkeypatch):
    """What a captured step stands for: two steps with one key issue the same launches (the model's and every
    layer's, the native ones as one call each) with the same arguments at the same addresses, the step's inputs
    (the token and its position, copied into a graph's buffers) and what the step made aside; and the launches
    change no host state of any layer and read nothing back to the host."""
    from test_decode_launches_repeat import _NATIVE_OPS, StepRecorder, _host_state, _recorded

    from kvtier import native

    model = tiny_llama()
    recorder: list = [None]

    class Everything(StepRecorder):   # every launch of the step, as one timeline (layer 0)
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            from kvtier.bench.launches import NO_KERNEL

            op = func.overloadpacket.__name__
            if not self.inside_native and op not in NO_KERNEL:
                self.note(op, "", 0, args, kwargs or {}, out)
            return out

    for name in _NATIVE_OPS:
        monkeypatch.setattr(native, name, _recorded(recorder, name))
    monkeypatch.setattr("test_decode_launches_repeat._layer_of", lambda frame: 0)
    by_key: dict = {}
    with _cache(model) as cache:
        graph = DecodeGraph(model, cache)
        run = graph.graphs.run

        def watched(key, inputs, work, **kwargs):
            k = key()

            def recorded(*given):
                before = [_host_state(e) for e in cache._engines]
                recorder[0] = Everything({t.untyped_storage().data_ptr(): n for t, n in
                                          zip(given, ("token", "position"))})
                try:
                    with recorder[0]:
                        out = work(*given)
                finally:
                    launches, recorder[0] = recorder[0].launches[0], None
                assert [_host_state(e) for e in cache._engines] == before, "the launches changed host state"
                by_key.setdefault(k, []).append(tuple(launches))
                return out

            return run(key, inputs, recorded, **kwargs)

        graph.graphs.run = watched
        _decode(graph, steps=40)
    from kvtier.bench.launches import HOST_READS

    # nothing in the step reads back to the host (a capture refuses a sync): the model's ops nor the cache's
    reads = {x[0] for launches in by_key.values() for step in launches for x in step if x[0] in HOST_READS}
    assert not reads, reads
    repeated = 0
    for launches in by_key.values():
        first = launches[0]
        assert first and any(x[0] == "attend_pages" for x in first) and any(x[0] == "mm" for x in first)
        for later in launches[1:]:
            assert later == first, [(a, b) for a, b in zip(first, later) if a != b][:2]
            repeated += 1
    assert repeated >= 20 and len(by_key) >= 2, (repeated, len(by_key))


def test_a_failure_among_the_launches_breaks_the_cache(monkeypatch):
    """Once some layers' launches ran, the host no longer knows the device's state: a failure there breaks the
    cache, which says so on every later call, until `reset`."""
    from kvtier.engine.layer import LayerEngine

    model = tiny_llama()
    with _cache(model) as cache:
        graph = DecodeGraph(model, cache)
        _decode(graph, steps=8)
        real = LayerEngine.steady_launches

        def fails_in_the_last_layer(self, *args, **kwargs):
            if self.layer_idx == len(cache._engines) - 1:
                raise RuntimeError("injected")
            return real(self, *args, **kwargs)

        monkeypatch.setattr(LayerEngine, "steady_launches", fails_in_the_last_layer)
        token = torch.tensor([[5]])
        with pytest.raises(RuntimeError, match="injected"):
            for _ in range(20):   # until a step is planned whole
                graph(token)
        monkeypatch.setattr(LayerEngine, "steady_launches", real)
        assert "injected" in cache.broken
        with pytest.raises(BrokenCacheError):
            graph(token)
        cache.reset()
        _decode(graph, steps=4)


def test_a_demotion_after_a_planned_step_fails_as_the_ordinary_commits_does(monkeypatch):
    """A planned step's demotions come once every layer's step is taken, under the cache's guard as the ordinary
    commit is: one that fails (its copy down refused for want of room) is a `CapacityError` naming the layer, and
    breaks the cache, every layer's step taken, exactly as the same failure in an ordinary step does."""
    from kvtier.engine.layer import LayerEngine

    model = tiny_llama()
    real = LayerEngine._to_host
    outcomes = {}
    for graphed in (False, True):
        with _cache(model) as cache:
            step = DecodeGraph(model, cache) if graphed else _plain(model, cache)
            _decode(step, steps=4)
            failed = []

            def refused_in_the_first_layer(self, *args, **kwargs):
                if self.layer_idx == 0 and not failed:
                    failed.append(self.seen)
                    raise OSError(28, "injected: no room for the copy down")
                return real(self, *args, **kwargs)

            monkeypatch.setattr(LayerEngine, "_to_host", refused_in_the_first_layer)
            with pytest.raises(CapacityError, match="layer 0 could not place the step's entries") as raised:
                for _ in range(200):
                    step(torch.tensor([[5]]))
            monkeypatch.setattr(LayerEngine, "_to_host", real)
            assert "layer 0 commit failed" in cache.broken
            with pytest.raises(BrokenCacheError):
                step(torch.tensor([[5]]))
            outcomes[graphed] = (str(raised.value), failed[0])
            if graphed:   # the demoting step was planned whole, its launches taken in every layer
                assert step.stats()["ordinary"] == 2 and len({e.seen for e in cache._engines}) == 1
    assert outcomes[True] == outcomes[False]


def test_a_failure_after_every_layer_of_a_demoting_step_leaves_the_ordinary_steps_cache(monkeypatch):
    """A planned step that fails after every layer's launches (here in the model's last norm) takes every
    layer's step and makes its demotions, as the ordinary step's commits had: the steps after give the same
    logits."""
    model = tiny_llama()
    runs = {}
    for graphed in (False, True):
        with _cache(model) as cache:
            step = DecodeGraph(model, cache) if graphed else _plain(model, cache)
            out = [_decode(step, steps=4)]
            first = cache._engines[0]
            while not first.pool.count + 1 > first.cfg.device_tokens(first.seen + 1):   # until a step demotes
                out.append(step(torch.tensor([[5]]))[:, -1:].clone())
            hook = model.model.norm.register_forward_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("after")))
            demotions = cache.stats()["demotions"]
            try:
                with pytest.raises(RuntimeError, match="after"):
                    step(torch.tensor([[7]]))
            finally:
                hook.remove()
            assert cache.broken is None and cache.stats()["demotions"] > demotions
            out.append(_decode(step, steps=8, prompt=torch.tensor([[9]])))
            runs[graphed] = torch.cat(out)
    assert torch.equal(runs[True], runs[False])


def test_steps_under_inference_mode_leave_a_cache_usable_outside_it():
    """What planning and the demotions after a planned step make is kept as plain tensors, as the ordinary
    step's guard keeps them: steps under `torch.inference_mode()` may be followed by steps outside it."""
    model = tiny_llama()
    runs = {}
    for graphed in (False, True):
        with _cache(model) as cache:
            step = DecodeGraph(model, cache) if graphed else _plain(model, cache)
            with torch.inference_mode():
                first = _decode(step, steps=30)
            runs[graphed] = torch.cat([first, _decode(step, steps=30, prompt=torch.tensor([[5]]))])
            if graphed:
                assert step.stats()["eager"] > 40, step.stats()
    assert torch.equal(runs[True], runs[False])


def test_steps_under_autocast_equal_ordinary_ones_without_its_cache_of_casts():
    """Under autocast, a planned step runs with autocast's cache of cast weights off (a captured graph would keep
    reading casts the cache frees when the region ends), which changes no value: the same logits as ordinary
    steps under the same autocast, and the cache's setting as it was after each step."""
    model = tiny_llama()
    seen, runs, cached = [], {}, {False: [], True: []}
    for graphed in (False, True):
        hook = model.register_forward_pre_hook(lambda *_: cached[graphed].append(torch.is_autocast_cache_enabled()))
        try:
            with _cache(model) as cache:
                step = DecodeGraph(model, cache) if graphed else _plain(model, cache)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    runs[graphed] = _decode(step, steps=20)
                    seen.append(torch.is_autocast_cache_enabled())
                if graphed:
                    assert step.stats()["eager"] > 10, step.stats()
        finally:
            hook.remove()
    assert torch.equal(runs[True], runs[False]) and seen == [True, True]
    assert all(cached[False])                             # ordinary steps: autocast as the caller set it
    assert cached[True].count(False) == step.stats()["eager"] and cached[True][0]   # planned ones: its cache off


def test_a_decode_graph_made_under_inference_mode_steps_outside_it():
    """Its own tensors (the position, the mask; on CUDA a graph's fixed inputs) are plain ones wherever it is
    made, so that a step outside inference mode may write them."""
    model = tiny_llama()
    with _cache(model) as twin:
        want = _decode(_plain(model, twin), steps=10)
    with _cache(model) as cache:
        with torch.inference_mode():
            graph = DecodeGraph(model, cache)
        got = _decode(graph, steps=10)
        assert graph.stats()["eager"] > 0
    assert torch.equal(got, want)


def test_prompts_windows_and_refusals():
    """A prompt runs the ordinary way; a model with sliding-window layers runs every step the ordinary way;
    a cache built for another model, a batch, or a setting that is not a bool is refused by name."""
    model = tiny_llama()
    with _cache(model) as cache:
        graph = DecodeGraph(model, cache)
        graph(_prompt(20))
        assert graph.stats()["ordinary"] == 1 and graph.stats()["eager"] == 0
        with pytest.raises(ConfigError, match=r"token of shape \[2, 1\]"):
            graph(torch.zeros(2, 1, dtype=torch.int64))
        with pytest.raises(ConfigError, match="enabled=1"):
            DecodeGraph(model, cache, enabled=1)
        with pytest.raises(ConfigError, match="another config"):
            DecodeGraph(tiny_llama(seed=1), cache)
    with pytest.raises(ConfigError, match="allowed: a TieredCache"):
        from transformers import DynamicCache

        DecodeGraph(model, DynamicCache())

    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, vocab_size=128, num_hidden_layers=4, sliding_window=64,
                           layer_types=["sliding_attention", "full_attention"] * 2)
    cfg._attn_implementation = "eager"
    hybrid = AutoModelForCausalLM.from_config(cfg).eval()
    with _cache(hybrid) as cache:
        graph = DecodeGraph(hybrid, cache)
        got = _decode(graph, steps=10)
    with _cache(hybrid) as cache:
        want = _decode(_plain(hybrid, cache), steps=10)
    assert torch.equal(got, want) and graph.stats()["ordinary"] == 11 and graph.stats()["eager"] == 0

    # a left-padded prompt: the windows keep the padding, which generate's mask hides at every step
    ids = torch.randint(1, 128, (1, 30), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[:, :20], mask[:, :20] = 0, 0
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, output_logits=True,
              return_dict_in_generate=True)
    with _cache(hybrid) as cache:
        want = hybrid.generate(ids, **kw, **cache_kwargs(cache))
    with _cache(hybrid) as cache:
        graph = DecodeGraph(hybrid, cache)
        got = graph.generate(ids, **kw)
        assert graph.stats()["ordinary"] == 12   # the prompt and 11 decode steps
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))


def test_a_step_refuses_what_is_not_token_ids():
    model = tiny_llama()
    with _cache(model) as cache:
        graph = DecodeGraph(model, cache)
        graph(_prompt(20))
        for bad, match in (([[5]], "token of type list"),
                           (torch.ones(1, 1), r"token of shape \[1, 1\] and torch.float32"),
                           (torch.ones(1, 1, dtype=torch.bool), r"token of shape \[1, 1\] and torch.bool"),
                           (torch.ones(1, 1, dtype=torch.uint8), r"token of shape \[1, 1\] and torch.uint8")):
            with pytest.raises(ConfigError, match=match + ".*allowed: a \\[1, n\\] tensor of integer token ids"):
                graph(bad)
        with pytest.raises(ConfigError, match="position_ids of type list; allowed"):
            graph(torch.tensor([[5]]), position_ids=[[20]])
        assert cache.broken is None and cache.get_seq_length() == 20


def test_a_graph_off_never_asks_for_a_key():
    """Where no graph is captured (a CPU), `StepGraphs.run` does not ask for the key: a planned step pays for
    its layers' keys only (made by `plan_steady`), not for the model's."""
    model = tiny_llama()
    with _cache(model) as cache:
        graph = DecodeGraph(model, cache)
        assert not graph.graphs.enabled and isinstance(graph.graphs, StepGraphs)
        called = []
        real = graph._key
        graph._key = lambda *a: called.append(1) or real(*a)
        _decode(graph, steps=10)
    assert graph.stats()["eager"] > 0 and not called



@pytest.mark.parametrize("padded", [False, True], ids=["plain", "left-padded"])
def test_generate_through_it_equals_generate(padded):
    """`DecodeGraph.generate` is `model.generate` over the cache with its one-token steps taken whole: the same
    tokens and logits, with a left-padded prompt too (its positions come from generate, its padding was never
    stored); the model's forward is given back after, also when generate fails."""
    model = tiny_llama()
    ids = _prompt(200)
    mask = torch.ones_like(ids)
    if padded:
        ids[:, :7] = 0
        mask[:, :7] = 0
    runs = {}
    for graphed in (False, True):
        with _cache(model) as cache:
            kwargs = dict(attention_mask=mask, max_new_tokens=40, do_sample=False, output_logits=True,
                          return_dict_in_generate=True)
            if graphed:
                graph = DecodeGraph(model, cache)
                out = graph.generate(ids, **kwargs)
                assert "forward" not in vars(model)
            else:
                out = model.generate(ids, **kwargs, **cache_kwargs(cache))
            runs[graphed] = (out.sequences, torch.stack(out.logits), cache.stats())
    assert torch.equal(runs[True][0], runs[False][0])
    assert torch.equal(runs[True][1], runs[False][1])
    _same_stats(runs[True][2], runs[False][2])
    s = graph.stats()
    assert s["eager"] > 3 * s["ordinary"], s
    with _cache(model) as cache:
        graph = DecodeGraph(model, cache)
        with pytest.raises(ConfigError, match="given a cache"):
            graph.generate(ids, **cache_kwargs(cache))
        with pytest.raises(Exception):
            graph.generate(ids, max_new_tokens=-3)
        assert "forward" not in vars(model)


def test_failures_break_the_cache_only_where_some_launches_ran(monkeypatch):
    """A planned step that fails before any layer launched (a bad token in the embedding) leaves the cache as it
    was; one whose model attention skipped kvtier in every layer says so and changes nothing; a step planned for
    an attention unlike the one the model then calls runs the ordinary way if no layer launched yet (the same
    logits), and breaks the cache where some layer had."""
    model = tiny_llama()
    with _cache(model) as cache:
        want = _decode(_plain(model, cache), steps=20)
    with _cache(model) as cache:
        graph = DecodeGraph(model, cache)
        got = [_decode(graph, steps=10)]
        token = got[0][-1:].argmax(-1)
        with pytest.raises(IndexError):
            graph(torch.tensor([[10_000]]))   # out of the vocabulary: fails in the embedding
        assert cache.broken is None
        engine = cache._engines[0]
        how = engine._steady_how
        engine._steady_how = (how[0] * 2, *how[1:])   # planned for another scale: refused before its launches
        before = graph.stats()["ordinary"]
        logits = graph(token)[:, -1:].clone()
        assert graph.stats()["ordinary"] == before + 1 and cache.broken is None
        out = [logits]
        for _ in range(9):
            out.append(graph(out[-1].argmax(-1))[:, -1:].clone())
        got.append(torch.cat(out))
        assert graph.stats()["eager"] > 10
    assert torch.equal(torch.cat(got), want)

    with _cache(model) as cache:
        graph = DecodeGraph(model, cache)
        token = _decode(graph, steps=10)[-1:].argmax(-1)
        last = cache._engines[-1]
        how = last._steady_how
        last._steady_how = (how[0] * 2, *how[1:])   # the first layer launched before the last one refused
        with pytest.raises(UnsupportedError, match="planned for the attention"):
            graph(token)
        assert "1 of 2 layers" in cache.broken

    from kvtier.integrations.attention import use_tiered_attention

    # the model's own attention over kvtier's placeholders: refused, nothing taken; the same where this call
    # captured a graph (on a GPU, a state's second step): no layer launched either
    for captured in (False, True):
        with _cache(model) as cache:
            graph = DecodeGraph(model, cache)
            token = _decode(graph, steps=10)[-1:].argmax(-1)
            seen = cache.get_seq_length()
            if captured:
                run = graph.graphs.run

                def capturing(key, inputs, work, lasting=True, graph=graph, run=run):
                    graph.graphs.captures += 1   # as a capture that succeeded would count
                    return run(key, inputs, work, lasting)

                monkeypatch.setattr(graph.graphs, "run", capturing)
            cache.detach_attention()
            try:
                with pytest.raises(UnsupportedError, match="did not run through kvtier"):
                    graph(token)
            finally:
                use_tiered_attention(model.config)
            assert cache.broken is None and cache.get_seq_length() == seen


def test_park_and_reset_let_the_whole_step_graph_go(monkeypatch):
    """A `DecodeGraph`'s graph holds the layers' pools and buffers by its key: it goes when a layer lets its
    recall buffer go (park, reset, close), as the layers' own graphs do."""
    model = tiny_llama()
    with _cache(model) as cache:
        graph = DecodeGraph(model, cache)
        token = _decode(graph, steps=10)[-1:].argmax(-1)
        cleared = []
        monkeypatch.setattr(graph.graphs, "clear", lambda: cleared.append(1))
        cache.park("host")
        assert cleared
        cache.resume()
        graph(token)
        cleared.clear()
        cache.reset()
        assert cleared


def test_a_layer_asked_to_prefetch_on_the_side_stream_is_never_planned():
    model = tiny_llama()
    with _cache(model) as cache:
        for engine in cache._engines:
            engine.prefetch_in_step = False
        graph = DecodeGraph(model, cache)
        _decode(graph, steps=10)
        assert graph.stats()["eager"] == 0 and graph.stats()["ordinary"] == 11


def test_the_key_follows_the_models_weights_where_they_lie():
    """A replay reads the weights at the addresses it captured: the key changes when a parameter's storage moves
    or a buffer is replaced (as moving or casting a model does), and stays while they do not."""
    model = tiny_llama()
    with _cache(model) as cache:
        graph = DecodeGraph(model, cache)
        token = _decode(graph, steps=10)[-1:].argmax(-1)
        plans = graph._plan()
        assert plans is not None
        key = graph._key(plans, token)
        assert graph._key(plans, token) == key
        rotary = model.model.rotary_emb
        rotary.inv_freq = rotary.inv_freq.clone()          # a buffer replaced
        moved = graph._key(plans, token)
        assert moved != key
        weight = model.model.layers[0].mlp.up_proj.weight
        weight.data = weight.data.clone()                  # a parameter's storage moved
        assert graph._key(plans, token) != moved


def test_an_interruption_before_the_host_takes_a_launched_step_takes_it(monkeypatch):
    """Ctrl-C once every layer's launches ran, before the host took the step: the step is taken (the device had
    moved on, the host not, and the next steps put their entries one slot too far with no error, logits off by
    0.05). The steps after equal those of a cache that took it the ordinary way."""
    model = tiny_llama()
    tokens = [torch.tensor([[t]]) for t in (5, 9, 17, 33, 65, 3, 99, 7, 11, 13, 21)]
    with torch.no_grad(), _cache(model) as cache:
        run = _plain(model, cache)
        run(_prompt())
        want = [run(t) for t in tokens][-4:]
    take, hit = DecodeGraph._take, []

    def interrupted(self, plans):
        if len(hit) == 0 and len(plans) and self.graphs.eager > 0:
            hit.append(1)
            raise KeyboardInterrupt
        return take(self, plans)

    monkeypatch.setattr(DecodeGraph, "_take", interrupted)
    with torch.no_grad(), _cache(model) as cache:
        graph = DecodeGraph(model, cache)
        graph(_prompt())
        got = []
        for t in tokens:
            try:
                got.append(graph(t))
            except KeyboardInterrupt:
                got.append(None)
        assert hit and got.count(None) == 1 and cache.broken is None
        assert all(torch.equal(a, b) for a, b in zip(got[-4:], want))


def test_a_misspelt_switch_is_refused_before_a_planned_step_launches(monkeypatch):
    """As an ordinary step refuses it: the cache not broken (the switch was first read inside layer 0's launches,
    after they began, which broke it)."""
    model = tiny_llama()
    with _cache(model) as cache, torch.no_grad():
        graph = DecodeGraph(model, cache)
        token = _decode(graph, steps=8)[-1:].argmax(-1)
        monkeypatch.setenv("KVTIER_NATIVE", "ture")
        with pytest.raises(ConfigError, match="KVTIER_NATIVE"):
            graph(token)
        assert cache.broken is None
        monkeypatch.delenv("KVTIER_NATIVE")
        graph(token)


def test_each_step_counts_once_however_it_ran():
    """A step refused by its planned launches and run the ordinary way counted as both `eager` and `ordinary`;
    `generate`'s prompt was counted as neither. Every forward call now counts once."""
    model = tiny_llama()
    with _cache(model) as cache, torch.no_grad():
        graph = DecodeGraph(model, cache)
        token = _decode(graph, steps=10)[-1:].argmax(-1)
        engine = cache._engines[0]
        how = engine._steady_how
        engine._steady_how = (how[0] * 2, *how[1:])   # planned for another scale: refused, then run ordinarily
        graph(token)
        s = graph.stats()
        assert cache.broken is None and s["eager"] + s["ordinary"] + s["replays"] == 12, s
    with _cache(model) as cache:
        graph = DecodeGraph(model, cache)
        out = graph.generate(_prompt(), max_new_tokens=8, do_sample=False)
        s = graph.stats()
        assert out.shape[1] == 208 and s["eager"] + s["ordinary"] + s["replays"] == 8, s
