"""The engine's device calls with their host inputs in one buffer.

A packed step takes 16 small host arrays (the packed stream's 9, the sampler's 5 settings, counters,
output slots) and a decode call 10; passed as they are, each is its own host-to-device copy, and
a GPU copy costs tens of microseconds of host time whatever its size, on the first token's path.
`HostInputs` lays the arrays of a call end to end in one int32 buffer (float32 ones bitcast, no
conversion), so a call sends one array (a packed step fills its buffer in place: `Slots`, filled
from the scheduled requests by `fill_packed`); the wrapped program slices it apart on the device
(static offsets: slices and reshapes, no copy worth a kernel). The layout (names, shapes, kinds)
is a static argument, so each bucket's shape still compiles once.

The weights go in as their flat list of leaves (`jax.tree.leaves(params)`, made once), rebuilt into
their tree inside the program: the call's argument walk over ~100 nested dicts and tuples was
about as costly as the rest of its dispatch (~160 of ~350 us per call for llama3_1b's 98 leaves
on the CPU here).

`fetch` reads a call's outputs back with one numpy conversion per array that the host uses
(`jax.device_get` on a dict costs ~50 us per leaf in its tree walk on the CPU here, against 4 us
for `np.asarray`), and never the decode call's `last` tokens (they stay on the device for the
chained call).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


class HostInputs:
    """Named int32 / float32 host arrays for one call, packed into one int32 buffer."""
    __slots__ = ("names", "arrays")

    def __init__(self):
        self.names, self.arrays = [], []

    def add(self, name: str, array) -> None:
        a = np.asarray(array)
        if a.dtype not in (np.int32, np.float32):
            raise TypeError(f"host input {name!r} is {a.dtype}; pass int32 or float32")
        self.names.append(name)
        self.arrays.append(a)

    def add_tree(self, prefix: str, tree: dict) -> None:
        for k, v in tree.items():
            self.add(f"{prefix}.{k}", v)

    def pack(self) -> tuple[np.ndarray, tuple]:
        """(buffer [total] int32, layout): the layout is hashable, a static argument."""
        layout = tuple((n, a.shape, "f" if a.dtype == np.float32 else "i") for n, a in zip(self.names, self.arrays))
        buf = np.concatenate([a.reshape(-1).view(np.int32) for a in self.arrays]) if self.arrays else \
            np.zeros(0, np.int32)
        return buf, layout


def decode_inputs(tok, pos, limit, table, slots, rows, counters, from_last) -> tuple[np.ndarray, tuple]:
    """(buffer, layout) of a decode call (decode_program)."""
    h = HostInputs()
    for name, a in (("tok", tok), ("pos", pos), ("limit", limit), ("table", table), ("slots", slots),
                    ("from_last", from_last)):
        h.add(name, a)
    h.add_tree("rows", rows)
    h.add("counters", counters)
    return h.pack()


class Slots:
    """A call's host inputs laid out once per shape, in one int32 buffer with named views (float32
    ones bitcast) that the caller fills in place: `fill()` resets the staging buffer to its padding
    values and returns its views, `take()` a copy to send (the CPU backend may read a numpy argument
    after the call has returned, so the staging buffer itself never leaves). A packed step built its
    16 arrays one by one and concatenated them: ~16 allocations and a copy, ~0.2 ms of host time on
    the CPU here, on the first token's path."""
    __slots__ = ("layout", "_staging", "_padding", "views")

    def __init__(self, entries, padding: dict | None = None):
        self.layout, spans, offset = tuple(entries), [], 0        # ((name, shape, "i" | "f"), ...)
        for name, shape, kind in self.layout:
            size = math.prod(shape)
            spans.append((name, offset, offset + size, shape, kind == "f"))
            offset += size
        self._staging = np.zeros(offset, np.int32)
        self.views = {name: (self._staging[a:b].view(np.float32) if f else self._staging[a:b]).reshape(shape)
                      for name, a, b, shape, f in spans}
        for name, value in (padding or {}).items():
            self.views[name][...] = value
        self._padding = self._staging.copy()

    def fill(self) -> dict:
        np.copyto(self._staging, self._padding)
        return self.views

    def take(self) -> np.ndarray:
        return self._staging.copy()


def packed_slots(n_dec: int, k: int, chunk: int, max_pages: int, rows: dict, max_seqs: int, num_pages: int,
                 score: bool = False) -> Slots:
    """The Slots of a packed step (packed_program) with n_dec decode tokens and k chunk rows `chunk`
    wide; rows: the sampler's per-row settings (their names and dtypes); score: with the chunk
    tokens' targets (the token each prompt logprob is of: programs._prompt_scores). Padding tokens have slot
    max_seqs (no seen row) and write page num_pages (no cache write); decode row i samples token i;
    no row reads or records a device-side last token (from_last, last_slot: max_seqs)."""
    t, r = n_dec + k * chunk, n_dec + k
    stream = [(f"p.{name}", (t,), "i") for name in ("tokens", "positions", "slot", "write_page", "write_off")]
    tables = [("p.dec_table", (n_dec, max_pages), "i"), ("p.dec_len", (n_dec,), "i"),
              ("p.pre_table", (k, max_pages), "i"), ("p.out_idx", (r,), "i"), ("p.from_last", (n_dec,), "i"),
              ("p.last_slot", (r,), "i")] + ([("p.targets", (k * chunk,), "i")] if score else [])
    settings = [(f"rows.{name}", (r,), "f" if a.dtype == np.float32 else "i") for name, a in rows.items()]
    return Slots(stream + tables + settings + [("counters", (r,), "i"), ("out_slot", (r,), "i")],
                 padding={"p.slot": max_seqs, "p.write_page": num_pages, "p.from_last": max_seqs,
                          "p.last_slot": max_seqs,
                          "p.out_idx": np.where(np.arange(r) < n_dec, np.arange(r), 0)})   # decode row i: token i


def feed_decodes(reqs, tok: np.ndarray, from_last: np.ndarray) -> None:
    """What each decode row is fed: its last token from the host (tok[i]), or, while its last sample is
    still on the device (Request.pending), its slot (from_last[i]: the program reads that slot's LAST
    entry). The other entry of each row keeps its padding (token 0, from_last max_seqs)."""
    for i, r in enumerate(reqs):
        if r.pending:
            from_last[i] = r.slot
        else:
            tok[i] = r.last_token()


def fill_packed(v: dict, decodes, prefills, table: np.ndarray, page_size: int, slot_rows: dict) -> np.ndarray:
    """Fill a packed step's views `v` (Slots.fill() of its bucket: n_dec decode tokens, then chunk rows
    of equal width) with `decodes` (requests feeding one token) and `prefills` ([(request, first position, tokens)]:
    a request's consecutive chunks may take several rows); table: the scheduler's page table. A
    decode row whose token is still on the device (Request.pending) is fed from the LAST entry of
    its slot; every row that samples a token it keeps (decodes, and prompts fed to their end) records
    it there. Returns the slots of the step's real output rows (decodes, then prefills), for its flags."""
    m, ps, out_slot, counters = len(decodes), page_size, v["out_slot"], v["counters"]
    nd, k = v["p.dec_len"].shape[0], v["p.pre_table"].shape[0]
    c = (v["p.tokens"].shape[0] - nd) // k                       # the chunk rows' width
    if m:
        dslots = np.array([r.slot for r in decodes], np.int32)
        dpos = np.array([r.cached for r in decodes], np.int32)
        feed_decodes(decodes, v["p.tokens"], v["p.from_last"])
        v["p.positions"][:m], v["p.slot"][:m], v["p.write_off"][:m] = dpos, dslots, dpos % ps
        v["p.write_page"][:m] = table[dslots, dpos // ps]
        v["p.dec_len"][:m] = dpos + 1
        v["p.dec_table"][:m] = table[dslots]
        out_slot[:m] = v["p.last_slot"][:m] = dslots
        counters[:m] = [len(r.output) + r.pending for r in decodes]
    for j, (r, start, n) in enumerate(prefills):
        base, pos = nd + j * c, np.arange(start, start + n, dtype=np.int32)
        v["p.tokens"][base:base + n] = r.token_ids(start + n)[start:]              # int32 already: a copy
        v["p.positions"][base:base + n], v["p.slot"][base:base + n] = pos, r.slot
        v["p.write_page"][base:base + n] = table[r.slot, pos // ps]
        off = v["p.write_off"][base:base + n]
        np.remainder(pos, ps, out=off)
        if start < r.prefix_hit_tokens:
            # a fully cached prompt's last token: its K/V already lie in a shared page, which no
            # request writes. An offset past the page drops the write (the scatter's mode="drop")
            # while write_page still counts the token as a real query of its row.
            off[pos < r.prefix_hit_tokens] = ps
        v["p.pre_table"][j] = table[r.slot]
        v["p.out_idx"][nd + j], out_slot[nd + j], counters[nd + j] = base + n - 1, r.slot, len(r.output)
        if start + n == r.n_tokens:                        # its prompt (or a preempted row's tokens) fed to the end
            v["p.last_slot"][nd + j] = r.slot
    for name, values in slot_rows.items():                # sampler settings of the output rows
        values.take(out_slot, out=v[f"rows.{name}"])
    return np.concatenate([out_slot[:m], out_slot[nd:nd + len(prefills)]]) if m else out_slot[nd:nd + len(prefills)]


def first_token_slots(b: int, max_pages: int, rows: dict, max_seqs: int) -> Slots:
    """The Slots of a one-step decode call over b rows (a bucket) fed from host tokens, some of them a
    prompt's last token (fill_decode): tokens and hit positions in the buffer. Padding rows have
    limit 0 (nothing fed or written) and seen slot max_seqs (no seen row)."""
    entries = [(name, (b,), "i") for name in ("tok", "pos", "limit", "slots", "hit")]
    entries += [("table", (b, max_pages), "i")]
    entries += [(f"rows.{name}", (b,), "f" if a.dtype == np.float32 else "i") for name, a in rows.items()]
    return Slots(entries + [("counters", (b,), "i")], padding={"slots": max_seqs})


def fill_decode(v: dict, reqs, table: np.ndarray, slot_rows: dict) -> np.ndarray:
    """Fill first_token_slots' views `v` (Slots.fill()) with `reqs` (each feeding one token at position
    r.cached: its last, prompt or output); returns their slots (for the step's flags)."""
    m = len(reqs)
    slots = _fill_rows(v, reqs, slot_rows)
    v["tok"][:m] = [r.last_token() for r in reqs]
    v["pos"][:m] = [r.cached for r in reqs]
    v["limit"][:m] = [r.end for r in reqs]
    v["hit"][:m] = [r.prefix_hit_tokens for r in reqs]
    v["table"][:m] = table[slots]
    return slots


def head_slots(b: int, rows: dict, max_seqs: int) -> Slots:
    """The Slots of a head call (head_program) over b rows: the page whose kept hidden state each row
    samples from, its slot, sampler settings and counters. Padding rows: page 0, seen slot max_seqs."""
    entries = [("page", (b,), "i"), ("slots", (b,), "i")]
    entries += [(f"rows.{name}", (b,), "f" if a.dtype == np.float32 else "i") for name, a in rows.items()]
    return Slots(entries + [("counters", (b,), "i")], padding={"slots": max_seqs})


def fill_head(v: dict, reqs, table: np.ndarray, page_size: int, slot_rows: dict) -> np.ndarray:
    """Fill head_slots' views with `reqs`, each sampling after its token at position r.cached (the
    last of a page whose hidden state is kept); returns their slots."""
    slots = _fill_rows(v, reqs, slot_rows)
    v["page"][:len(reqs)] = table[slots, np.array([r.cached for r in reqs]) // page_size]
    return slots


def _fill_rows(v: dict, reqs, slot_rows: dict) -> np.ndarray:
    """The per-row entries a one-row-per-request call shares: slots, counters, sampler settings (padding
    rows take slot 0's, ignored). Returns the requests' slots."""
    m = len(reqs)
    slots = np.array([r.slot for r in reqs], np.int32)
    v["slots"][:m] = slots
    v["counters"][:m] = [len(r.output) for r in reqs]
    pad = np.zeros(len(v["slots"]), np.intp)
    pad[:m] = slots
    for name, values in slot_rows.items():
        values.take(pad, out=v[f"rows.{name}"])
    return slots


def unpack(buf, layout) -> dict:
    """Inside a jit: the named arrays of `layout` sliced out of buf; "a.b" names become nested dicts."""
    out, offset = {}, 0
    for name, shape, kind in layout:
        size = math.prod(shape)
        x = buf[offset:offset + size].reshape(shape)
        if kind == "f":
            x = jax.lax.bitcast_convert_type(x, jnp.float32)
        offset += size
        node, *rest = name.split(".")
        if rest:
            out.setdefault(node, {})[rest[0]] = x
        else:
            out[node] = x
    return out


def pinned_shardings(like: jax.Array) -> tuple:
    """(pinned host, device) shardings of the one device that `like` lives on, for a call's input
    buffer passed in pinned host memory (packed_program's on_device)."""
    from jax.sharding import SingleDeviceSharding
    devices = like.devices()
    if len(devices) != 1:
        raise ValueError(f"pinned_inputs needs the engine on one device; its cache spans {len(devices)}")
    dev = next(iter(devices))
    return tuple(SingleDeviceSharding(dev, memory_kind=kind) for kind in ("pinned_host", "device"))


def state_first(result: tuple) -> tuple:
    """A program's (outputs, cache, seen) as (cache, seen, outputs), the order the engine's jitted calls
    return. jax pairs each donated input with the first output of its shape and dtype, in output
    order: with the outputs first, a call's sampled tokens [b] would take the donated LAST entry
    [max_seqs] whenever b == max_seqs, the cache's own LAST would get a new buffer, and the next call
    would meet an input at a new device address and pay the command buffer's update in its dispatch."""
    out, cache, seen = result
    return cache, seen, out


# The programs' static arguments have no defaults: jax keys a jitted function's cache by the arguments
# passed, so one left to its default in a call (warmup) and given in another (a step) would trace and
# compile a second program at that step, ~0.5 s at llama3_1b on a GPU.
def packed_program(packed_step, treedef, compiler_options: dict | None = None, on_device=None):
    """packed_step (programs.make_engine_programs) taking (weights, cache, seen, buf, layout): weights
    the leaves of params (of structure treedef), the buffer holds p.*, rows.*, counters and out_slot.
    compiler_options: XLA options for its compiles (jax.jit's), e.g. command buffers off. on_device:
    the buffer comes in pinned host memory and the program copies it to this sharding first."""
    def call(weights, cache, seen, buf, layout, greedy, logprobs, score, cut, ranks):
        if on_device is not None:
            buf = jax.device_put(buf, on_device)
        params, a = jax.tree.unflatten(treedef, weights), unpack(buf, layout)
        return state_first(packed_step(params, cache, seen, a["p"], a["rows"], a["counters"], a["out_slot"],
                                       greedy=greedy, logprobs=logprobs, score=score, cut=cut, ranks=ranks))
    return jax.jit(call, donate_argnums=(1, 2), static_argnames=("layout", "greedy", "logprobs", "score", "cut", "ranks"),
                   compiler_options=compiler_options)


def decode_program(decode_loop, treedef, compiler_options: dict | None = None):
    """decode_loop taking (weights, cache, seen, buf, layout): weights and compiler_options as in
    packed_program, the buffer holds tok, pos, limit, table, slots, rows.* and counters. A row whose
    last sample is still on the device (a chained call's rows, Request.pending) names its slot in
    "from_last" and is fed that slot's LAST token: the call's only input is the host buffer, so no
    input of a decode call sits at a device address the call before did not use (a new one costs
    the GPU's command buffer an update in the dispatch). With "hit" in the buffer (first_token_slots),
    rows whose position lies below their hit are fed without changing their shared page (decode_loop's keep)."""
    def call(weights, cache, seen, buf, layout, n, greedy, logprobs, cut):
        params, a = jax.tree.unflatten(treedef, weights), unpack(buf, layout)
        return state_first(decode_loop(params, cache, seen, a["tok"], a["pos"], a["limit"], a["table"], a["slots"],
                                       a["rows"], a["counters"], n=n, greedy=greedy, logprobs=logprobs,
                                       keep=a.get("hit"), from_last=a.get("from_last"), cut=cut))
    return jax.jit(call, donate_argnums=(1, 2), static_argnames=("layout", "n", "greedy", "logprobs", "cut"),
                   compiler_options=compiler_options)


def head_program(head_step, treedef, compiler_options: dict | None = None):
    """head_step (programs.make_head_program) taking (weights, cache, seen, buf, layout): weights the
    leaves of programs.head_params (of structure treedef), the buffer holds page, slots, rows.* and
    counters (head_slots)."""
    def call(weights, cache, seen, buf, layout, greedy, logprobs, cut):
        params, a = jax.tree.unflatten(treedef, weights), unpack(buf, layout)
        return state_first(head_step(params, cache, seen, a["page"], a["slots"], a["rows"], a["counters"],
                                     greedy=greedy, logprobs=logprobs, cut=cut))
    return jax.jit(call, donate_argnums=(1, 2), static_argnames=("layout", "greedy", "logprobs", "cut"),
                   compiler_options=compiler_options)


def fetch(out: dict) -> dict:
    """The host copies of a call's outputs (all started before the first is waited for)."""
    if len(out) > 1:                       # overlap the copies (a lone one would only pay for the call)
        for v in out.values():
            v.copy_to_host_async()
    return {k: np.asarray(v) for k, v in out.items()}


def logprob_rows(out: dict, axis: int) -> list:
    """Per row (`axis` of the outputs), its tokens' (logprob, top ids, top logprobs) as Python numbers:
    one conversion per call. Per token, numpy scalars and slices cost ~6 ms of the engine thread's
    host time per 128-row decode call with logprobs on the CPU here."""
    lp = np.moveaxis(out["logprob"], axis, 0).reshape(out["logprob"].shape[axis], -1).tolist()   # [rows, n]
    if not out["top_id"].shape[-1]:       # only the chosen tokens' logprobs were asked
        return [[(x, (), ()) for x in row] for row in lp]
    ids, vals = (np.moveaxis(out[k], axis, 0).reshape(len(lp), -1, out[k].shape[-1]).tolist()
                 for k in ("top_id", "top_logprob"))
    return [list(zip(*row)) for row in zip(lp, ids, vals)]
