"""Pass 1b — classify attention masks: recognise causal masks built in-graph, and what narrows them.

Hugging Face models under ``torch.compile`` build an explicit ``[B, 1, S, S]`` mask from index
comparisons and the ``attention_mask`` input and call SDPA with ``is_causal=False``. At long
context that mask alone outweighs everything else. This pass works out what the mask *means* by
evaluating its subgraph symbolically (``passes/mask_expr.py``): every element
``mask[b, h, q, k]`` becomes an expression over the index variables and the graph's inputs
(``kv_idx <= q_idx``, ``attention_mask[b, kv_idx]``, ...). When the expression is a
conjunction of

* the causal comparison ``k <= q`` (possibly written any way a linear comparison can be),
* a sliding window ``q - k < W`` (however written; W narrower than the sequence narrows each
  query's keys, a wider one is always true and dropped; layers may differ: each SDPA call's
  mask is classified on its own),
* documents: ``ids[b, q] == ids[b, k]`` where ``ids`` is a cumulative sum of a bool along the
  sequence (so equal ids are contiguous runs). Packed sequences are the case transformers
  builds from restarting ``position_ids``: ids ``cumsum(diff(P) != 1)`` and the causal (and
  window) comparisons written on the positions ``P[b, k] <= P[b, q]``, which equal the index
  comparisons exactly because the documents are P's runs of +1 steps (checked in the graph),
* terms of ``(b, k)`` only — key padding — that can be computed as a ``[B, S]`` tensor,
* comparisons that are always true at this length,

the SDPA call becomes ``causal_attention(q, k, v, key_valid, scale, window=W, doc_ids=ids)``:
the zigzag kernel, which skips key blocks outside the window or the document, with no
``S x S`` (or ``c x S``) tensor anywhere (the mask subgraph becomes dead code).

An explicit ``[B|1, 1, S, S]`` mask passed in by the user (a packed batch's block-diagonal
mask) is data: ``tspc::documents_of_mask`` derives document ids from it on every call,
checking a band of rows at a time that each batch row is block-diagonal causal; a row that is
not runs exactly on its own mask rows, a tile at a time (the input itself is S x S; nothing
else is). Anything else is left alone and reported; the sequence pass then cuts the mask's
query rows, which is always exact.

Additive float masks (``0`` where attending, a very negative value elsewhere, as eager attention
uses) are recognised through ``where``/``masked_fill`` forms of a boolean condition. The masked
value decides what a query row that sees no key (left padding) computes — with finfo.min it
attends uniformly to every key, with a bool mask it is 0 — so it travels with the call
(``masked_value``, and ``safe_softmax``: SDPA's softmax or eager code's) and the kernel gives
that row exactly what the model's own softmax gives it, forward and backward
(``tspc/ops/masked_rows.py``). An additive mask that is not recognised runs as
``masked_attention``: torch's SDPA with those rows made exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from tspc.ops.masked_rows import masked_attention
from tspc.ops.zigzag_attention import causal_attention  # also registers tspc::documents_of_mask

from .graph_utils import (
    arg,
    eliminate_dead_code,
    op_name,
    set_fake_value,
    shape,
    tensor_val,
)
from .mask_expr import COMPARISONS, NEGATED, KeyTermEmitter, MaskEvaluator, Opaque
from .match_attention import sdpa_args

# --------------------------------------------------------------------------- classification


def _linear(e) -> dict | None:
    """A linear form {var or 1: coeff} of an index expression, or None."""
    if e[0] == "idx":
        return {e[1]: 1}
    if e[0] == "const" and isinstance(e[1], int) and not isinstance(e[1], bool):
        return {1: e[1]}
    if e[0] == "leaf":  # an element of a value (position ids at q or k): a variable of its own
        return {e: 1}
    if e[0] == "op" and e[1] in ("add", "sub") and len(e[2]) == 2:
        a, b = _linear(e[2][0]), _linear(e[2][1])
        if a is None or b is None:
            return None
        sign = 1 if e[1] == "add" else -1
        out = dict(a)
        for k, v in b.items():
            out[k] = out.get(k, 0) + sign * v
        return out
    if e[0] == "op" and e[1] == "mul":
        a, b = e[2]
        if b[0] == "const":
            la = _linear(a)
            return None if la is None else {k: v * b[1] for k, v in la.items()}
    return None


def _comparison(e, negated: bool) -> tuple[dict, int] | None:
    """``sum(coeff * idx) <= bound`` equivalent to a comparison of linear index expressions."""
    if e[0] != "op" or e[1] not in COMPARISONS or e[1] in ("eq", "ne"):
        return None
    name = NEGATED[e[1]] if negated else e[1]
    a, b = _linear(e[2][0]), _linear(e[2][1])
    if a is None or b is None:
        return None
    diff = dict(a)
    for k, v in b.items():
        diff[k] = diff.get(k, 0) - v
    c = diff.pop(1, 0)
    if name in ("ge", "gt"):
        diff = {k: -v for k, v in diff.items()}
        c = -c
    bound = -c - (1 if name in ("lt", "gt") else 0)  # integer indices: x < 0 <=> x <= -1
    return {k: v for k, v in diff.items() if v}, bound


def _conjuncts(e, out: list) -> None:
    if e[0] == "op" and e[1] == "and":
        for a in e[2]:
            _conjuncts(a, out)
    elif e[0] == "bool" and e[1][0] == "op" and e[1][1] in COMPARISONS | {"and", "not"}:
        _conjuncts(e[1], out)
    else:
        out.append(e)


def _vars(e) -> set:
    if e[0] == "idx":
        return {e[1]}
    if e[0] == "const" or e[0] == "tensor":
        return set()
    if e[0] == "leaf":
        return set().union(*(_vars(i) for i in e[2])) if e[2] else set()
    if e[0] == "bool":
        return _vars(e[1])
    return set().union(*(_vars(a) for a in e[2]))


def _has_leaf(e) -> bool:
    if e[0] == "leaf":
        return True
    if e[0] in ("op",):
        return any(_has_leaf(a) for a in e[2])
    if e[0] == "bool":
        return _has_leaf(e[1])
    return False


def _condition(e, dtype: torch.dtype):
    """(condition, masked value) of a mask: a bool mask is its own condition; an additive
    float mask encodes where(C, 0, very negative)."""
    if dtype == torch.bool:
        return e, None
    if e[0] == "op" and e[1] == "where":
        c, a, b = e[2]
        if a == ("const", 0) and b[0] == "const" and b[1] <= -1e4:
            return c, b[1]
        if b == ("const", 0) and a[0] == "const" and a[1] <= -1e4:
            return ("op", "not", (c,)), a[1]
        # a mask written over another with the same masked value (``mask[:, :2] = -inf`` on
        # a causal mask, made pure as a masked_fill): attend where neither masks
        if a[0] == "const" and a[1] <= -1e4:
            rest, value = _condition(b, dtype)
            if rest is not None and value == a[1]:
                return ("op", "and", (("op", "not", (c,)), rest)), value
        if b[0] == "const" and b[1] <= -1e4:
            rest, value = _condition(a, dtype)
            if rest is not None and value == b[1]:
                return ("op", "and", (c, rest)), value
    if e[0] == "op" and e[1] == "add" and len(e[2]) == 2:
        # two -inf masks added (an attention mask plus a key padding mask, as
        # nn.MultiheadAttention adds them): where(C1 and C2, 0, -inf). Finite values are not
        # folded: where both mask a key, their sum differs from either.
        (c1, v1), (c2, v2) = (_condition(x, dtype) for x in e[2])
        if c1 is not None and c2 is not None and v1 == v2 == float("-inf"):
            return ("op", "and", (c1, c2)), v1
    return None, None


@dataclass
class MaskMeaning:
    kind: str  # "causal"
    key_valid: tuple | None  # expression of (b, k), or None when every key is valid
    dropped: list[str]
    window: int | None = None  # query q sees keys q - window < k <= q
    doc_ids: fx.Node | None = None  # [B|1, S]: q sees only keys of its own (contiguous) run
    doc_source: str = ""  # how the documents were found (for the report)
    # an explicit [B|1, 1, S, S] mask input: documents derived from it (and checked) per call
    user_mask: fx.Node | None = None
    # the longest sequence at which the dropped terms are still always true (a window at least
    # as wide as the sequence); None: the meaning holds at every length
    longest: int | None = None
    # an additive mask's value at a masked key (None: a bool mask): what a row that sees no
    # key attends with
    masked_value: float | None = None

    def describe(self, key_padding: bool) -> str:
        if self.user_mask is not None:
            return f"documents from {self.doc_source}"
        out = "causal"
        if self.window is not None:
            out += f" + sliding window {self.window}"
        if self.doc_ids is not None or self.user_mask is not None:
            out += f" + documents ({self.doc_source})"
        if key_padding:
            out += " + key padding"
            if self.masked_value is not None and math.isfinite(self.masked_value):
                v = self.masked_value
                out += f" (a row that sees no key: softmax(scores + ({v:g})) over every key)"
        if self.dropped:
            out += " (" + "; ".join(self.dropped) + ")"
        return out


def _position_leaf(e) -> tuple[fx.Node, int] | None:
    """(node, 2 or 3) when ``e`` is ``node[b, q]`` or ``node[b, k]`` of a [B|1, S] value."""
    if e[0] != "leaf" or len(e[2]) != 2:
        return None
    b, i = e[2]
    if b not in (("idx", 0), ("const", 0)) or i not in (("idx", 2), ("idx", 3)):
        return None
    return e[1], i[1]


def _input_name(n: fx.Node) -> str:
    """``position_ids`` for Dynamo's placeholder ``l_kwargs_position_ids_``."""
    if n.op != "placeholder":
        return n.name
    name = n.name
    for prefix in ("l_kwargs_", "l_args_"):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return name.strip("_")


def _through_casts(n):
    while isinstance(n, fx.Node) and op_name(n) in ("to", "int", "long", "type") and n.args:
        n = n.args[0]
    return n


def _consecutive(ev: MaskEvaluator, pos: fx.Node) -> bool:
    """Are the position ids ``pos[b, q]`` the index ``q`` plus a constant (built in the graph
    from ``arange``)?"""
    tv = tensor_val(pos)
    if tv is None or tv.dim() != 2:
        return False
    try:
        e = ev.expr(pos, (("idx", 0), ("idx", 2)))
    except (Opaque, ValueError, TypeError):
        return False
    lin = _linear(e)
    return lin is not None and {k: v for k, v in lin.items() if k != 1} == {2: 1}


def _run_ids(doc: fx.Node) -> tuple[bool, fx.Node | None]:
    """Is ``doc`` a cumulative sum along the sequence of a bool (so equal ids are contiguous
    runs)? And, when the bool is ``diff(P) != 1``, the position ids P whose runs of +1 steps
    the documents are (transformers' ``find_packed_sequence_indices``)."""
    doc = _through_casts(doc)
    if op_name(doc) != "cumsum":
        return False, None
    dim = arg(doc, 1, "dim")
    tv = tensor_val(doc)
    if tv is None or tv.dim() != 2 or dim not in (1, -1):
        return False, None
    x = _through_casts(doc.args[0])
    xv = tensor_val(x)
    if xv is None or xv.dtype != torch.bool:
        return False, None
    if op_name(x) == "ne" and len(x.args) == 2 and x.args[1] == 1:
        d = x.args[0]
        is_diff = isinstance(d, fx.Node) and op_name(d) == "diff"
        if is_diff and arg(d, 2, "dim", -1) in (1, -1) and arg(d, 1, "n", 1) == 1:
            return True, d.args[0]
    return True, None


USER_MASK_SOURCE = (
    "a 4-D mask input: every call checks, a band of rows at a time, that each batch row is "
    "block-diagonal causal (per-document causal attention, no S x S tensor); a row that is not "
    "runs on its own mask rows, a tile at a time (exact)"
)


def _user_mask(e, s: int) -> MaskMeaning | str | None:
    """An explicit ``[B|1, 1, S, S]`` mask input used as it is (a packed batch's block mask):
    its values are data, so what it means is decided per call (``documents_of_mask``)."""
    if e[0] != "leaf" or e[1].op != "placeholder" or len(e[2]) != 4:
        return None
    node, (b, _, q, k) = e[1], e[2]
    tv = tensor_val(node)
    if tv is None or tv.dim() != 4 or tuple(tv.shape[1:]) != (1, s, s):
        return None
    if b not in (("idx", 0), ("const", 0)) or q != ("idx", 2) or k != ("idx", 3):
        return None
    if tv.dtype != torch.bool and not tv.dtype.is_floating_point:
        return f"an integer 4-D mask input ({tv.dtype})"
    return MaskMeaning("causal", None, [], doc_source=USER_MASK_SOURCE, user_mask=node)


# Largest value (elements) evaluated on real data when it depends on no input (in-graph ids).
FOLD_LIMIT = 1 << 16


def classify(mask: fx.Node, s_q: int, s_k: int, fold_limit: int | None = None) -> MaskMeaning | str:
    """What ``mask`` (an SDPA attn_mask node) means, or a string saying why it is not known."""
    fold_limit = FOLD_LIMIT if fold_limit is None else fold_limit
    tv = tensor_val(mask)
    if tv is None:
        return "the mask is not a tensor"
    ndim = tv.dim()
    idx = tuple(("idx", 4 - ndim + i) for i in range(ndim))
    ev = MaskEvaluator(fold_limit)
    try:
        e = ev.expr(mask, idx)
    except (Opaque, ValueError, TypeError) as err:
        return f"mask not analysable: {err}"
    user = _user_mask(e, s_q)
    if user is not None:
        return user
    cond, off_value = _condition(e, tv.dtype)
    if cond is None:
        return "float mask is not of the form where(condition, 0, -large)"
    parts: list = []
    _conjuncts(cond, parts)
    causal = False
    windows: list[int] = []
    key_terms = []
    dropped = []
    longest: list[int] = []  # the longest length at which each dropped term is always true
    docs: set[fx.Node] = set()
    # comparisons of position ids P[b, q], P[b, k] (packed sequences): (P, "causal" | W)
    positional: list[tuple[fx.Node, object]] = []
    for p in parts:
        if p == ("const", True) or p == ("const", 1):
            continue
        negated = False
        q = p
        while q[0] == "op" and q[1] == "not":
            negated, q = not negated, q[2][0]
        cmp = _comparison(q, negated)
        if not _has_leaf(q):
            if cmp is None:
                return f"unrecognised index condition {p}"
            coeffs, bound = cmp
            if coeffs == {3: 1, 2: -1} and bound == 0:
                causal = True
                continue
            if coeffs == {2: 1, 3: -1} and bound >= s_q - 1:  # q - k <= W - 1 with W >= S
                dropped.append(f"window q-k <= {bound} (always true at length {s_q})")
                longest.append(bound + 1)
                continue
            if coeffs == {2: 1, 3: -1} and bound >= 0:  # a sliding window q - k < W
                windows.append(bound + 1)
                continue
            if coeffs == {3: 1, 2: -1} and bound >= s_k - 1:
                dropped.append("an always-true comparison")
                longest.append(bound + 1)
                continue
            if not _vars(p) <= {0, 3}:
                return f"unsupported index condition {p}"
        # terms of (b, k) only: key padding (an input's, or keys hidden by index, as in
        # ``mask[:, :2] = -inf``)
        if _vars(p) <= {0, 3}:
            key_terms.append(p)
            continue
        if not negated and q[0] == "op" and q[1] == "eq":
            sides = [_position_leaf(x) for x in q[2]]
            if all(sides) and sides[0][0] is sides[1][0] and {sides[0][1], sides[1][1]} == {2, 3}:
                if _run_ids(sides[0][0])[0]:
                    docs.add(sides[0][0])
                    continue
                return f"documents whose ids are not contiguous runs (not a cumsum): {p}"
        if cmp is not None and len(cmp[0]) == 2:
            coeffs, bound = cmp
            (a, ca), (b, cb) = coeffs.items()
            la, lb = _position_leaf(a), _position_leaf(b)
            if la and lb and la[0] is lb[0] and {ca, cb} == {1, -1}:
                pos = {la[1]: ca, lb[1]: cb}
                if pos == {3: 1, 2: -1} and bound == 0:
                    positional.append((la[0], "causal"))
                    continue
                if pos == {2: 1, 3: -1} and bound >= 0:
                    positional.append((la[0], bound + 1))
                    continue
        return f"a mask term depends on the query position and an input: {p}"
    if len(docs) > 1:
        return "more than one document-id tensor"
    doc = next(iter(docs), None)
    doc_source = ""
    if doc is not None:
        doc_source = "ids from a cumulative sum"
        pos = _run_ids(doc)[1]
        if pos is not None and _consecutive(ev, pos):
            # position ids built in the graph (arange): one run, one document per row —
            # what transformers' packed-sequence check gives when nothing is packed
            dropped.append(f"documents of consecutive {_input_name(pos)}: one per row")
            doc = None
    for pos, what in positional:
        # Comparing positions equals comparing indices only inside a run of +1 steps of P:
        # the documents must be exactly those runs.
        if doc is None or _run_ids(doc)[1] is not pos:
            return (
                f"the mask compares position ids ({pos.name}) without documents that are "
                "their runs of consecutive positions"
            )
        doc_source = f"runs of consecutive {_input_name(pos)}"
        if what == "causal":
            causal = True
        elif what >= s_q:
            dropped.append(f"window {what} (always true at length {s_q})")
            longest.append(what)
        else:
            windows.append(what)
    if not causal:
        return "the mask is not causal"
    key = None
    for t in key_terms:
        key = t if key is None else ("op", "and", (key, t))
    window = min(windows) if windows else None
    return MaskMeaning(
        "causal", key, dropped, window, doc, doc_source, longest=min(longest, default=None),
        masked_value=None if off_value is None else float(off_value),
    )  # fmt: skip


def _new_nodes_feeding(kv: fx.Node, stop: fx.Node) -> list[fx.Node]:
    out, stack = [], [kv]
    while stack:
        n = stack.pop()
        for i in n.all_input_nodes:
            if i.op in ("call_function", "call_method") and "val" in i.meta and i not in out:
                out.append(i)
    return out


@dataclass
class MaskReport:
    sdpa: str
    module: str
    recognised: bool
    detail: str
    # what ran: "causal", "sliding_window", "documents", "sliding_window+documents", or
    # "dense_rows" (not recognised: each rank cuts its query rows of the mask — exact)
    kind: str = "dense_rows"
    window: int | None = None
    documents: str | None = None  # where the document ids came from
    # the longest sequence this meaning holds at (a window dropped as at least as wide as the
    # sequence); None: every length (``tspc/length_family.py`` reads it)
    longest: int | None = None


def _kind_of(meaning: MaskMeaning) -> str:
    parts = []
    if meaning.window is not None:
        parts.append("sliding_window")
    if meaning.doc_ids is not None or meaning.user_mask is not None:
        parts.append("documents")
    return "+".join(parts) or "causal"


def _keep_full(n: fx.Node) -> None:
    """``n`` and the values it is computed from stay whole on every rank: every query
    chunk needs every key's document id (they are [B, S] integers, not S x S)."""
    stack = [n]
    while stack:
        x = stack.pop()
        if x.op not in ("call_function", "call_method") or x.meta.get("tspc_keep_full"):
            continue
        x.meta["tspc_keep_full"] = True
        stack.extend(x.all_input_nodes)


def _document_ids(g: fx.Graph, doc: fx.Node, batch: int, before: fx.Node) -> fx.Node:
    """The [B, S] document ids the kernel takes (``doc`` may have batch 1)."""
    _keep_full(doc)
    if shape(doc)[0] == batch:
        return doc
    with g.inserting_before(before):
        out = set_fake_value(g.call_method("expand", (doc, batch, -1)))
    out.meta["tspc_keep_full"] = True
    return out


def _exact_masked_rows(node: fx.Node, safe: bool) -> None:
    """An SDPA call with an additive mask the passes do not read: ``masked_attention`` (the
    same arguments), whose rows hidden from every key are what the model's softmax gives."""
    mask = sdpa_args(node)["attn_mask"]
    tv = tensor_val(mask) if isinstance(mask, fx.Node) else None
    if tv is not None and tv.dtype.is_floating_point:
        node.target = masked_attention
        node.kwargs = {**node.kwargs, "safe_softmax": safe}


def classify_masks(gm: fx.GraphModule) -> list[MaskReport]:
    """Replace SDPA calls whose explicit mask is causal (+ window, documents, key padding) by
    ``causal_attention``, and those with another additive mask by ``masked_attention``; report
    what every mask was recognised as, or why not."""
    from .graph_utils import node_module_fqn

    reports = []
    cache: dict[fx.Node, MaskMeaning | str] = {}
    key_nodes: dict[tuple, fx.Node] = {}
    doc_nodes: dict[fx.Node, fx.Node] = {}
    g = gm.graph
    for node in list(g.nodes):
        if op_name(node) != "sdpa" or node.target in (causal_attention, masked_attention):
            continue
        a = sdpa_args(node)
        mask = a["attn_mask"]
        if not isinstance(mask, fx.Node) or a["is_causal"] or a["dropout_p"] not in (0, 0.0):
            continue
        # eager softmax(scores + mask) @ v made SDPA: a row masked at every key follows eager
        # code's softmax (NaN for -inf), not SDPA's safe one (0)
        safe = node.meta.get("tspc_canonical") != "eager_attention"
        qs, ks = shape(a["query"]), shape(a["key"])
        if len(qs) != 4 or qs[2] != ks[2]:
            _exact_masked_rows(node, safe)
            continue
        if mask not in cache:
            cache[mask] = classify(mask, qs[2], ks[2])
        meaning = cache[mask]
        where = node_module_fqn(node)
        if isinstance(meaning, str):
            reports.append(MaskReport(node.name, where, False, meaning))
            _exact_masked_rows(node, safe)
            continue
        key_valid = None
        if meaning.key_valid is not None:
            if meaning.key_valid not in key_nodes:
                try:
                    with g.inserting_before(node):
                        kv = KeyTermEmitter(g, qs[0], ks[2], a["query"]).emit(meaning.key_valid)
                        if tensor_val(kv) is None:
                            set_fake_value(kv)
                        if tensor_val(kv).dtype != torch.bool:
                            kv = set_fake_value(g.call_method("bool", (kv,)))
                except Opaque as err:
                    reports.append(MaskReport(node.name, where, False, f"key padding: {err}"))
                    _exact_masked_rows(node, safe)
                    continue
                # the key padding must stay whole: every rank attends to every key
                kv.meta["tspc_keep_full"] = True
                for n in _new_nodes_feeding(kv, node):
                    n.meta["tspc_keep_full"] = True
                key_nodes[meaning.key_valid] = kv
            key_valid = key_nodes[meaning.key_valid]
        doc_ids = None
        if meaning.user_mask is not None and meaning.user_mask not in doc_nodes:
            with g.inserting_before(node):
                op = torch.ops.tspc.documents_of_mask.default
                ids = set_fake_value(g.call_function(op, (meaning.user_mask,)))
            doc_nodes[meaning.user_mask] = _document_ids(g, ids, qs[0], node)
        doc_src = meaning.doc_ids if meaning.user_mask is None else meaning.user_mask
        if doc_src is not None:
            if doc_src not in doc_nodes:
                doc_nodes[doc_src] = _document_ids(g, doc_src, qs[0], node)
            doc_ids = doc_nodes[doc_src]
        scale = a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(qs[3])
        node.target = causal_attention
        node.args = (a["query"], a["key"], a["value"], key_valid, float(scale))
        node.kwargs = {
            "window": meaning.window,
            "doc_ids": doc_ids,
            "masked_value": meaning.masked_value,
            "safe_softmax": safe,
        }
        if meaning.user_mask is not None:
            node.kwargs = {**node.kwargs, "dense_mask": meaning.user_mask}
        reports.append(
            MaskReport(
                node.name,
                where,
                True,
                meaning.describe(key_valid is not None),
                kind=_kind_of(meaning),
                window=meaning.window,
                documents=meaning.doc_source or None,
                longest=meaning.longest,
            )
        )
    eliminate_dead_code(g)
    gm.recompile()
    return reports
