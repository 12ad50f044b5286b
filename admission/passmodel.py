"""The pass model: what one pass costs, from what it carries. Pure arithmetic, no I/O.

    IO      = bytes streamed / read bandwidth
    compute = fixed + packed (if more than one row) + per_row x decode rows + per_prefill x prefill tokens
              + per_context x context + per_product x products beyond the first
              + per_prefill_context x prompt tokens x the keys each scores (its prompt cached, its chunk)
    pass    = max(IO, compute) + (1 - overlap) x min(IO, compute) + overhead
            = IO + read tail + overhead, where the read is longer and passes have timed the tail (at least that where not)
            + draft, where decode rows carry drafts (columns > 1): what drafting passes ran beyond their price

`overlap` is how much of the shorter term hides under the longer one (1: perfect double buffering,
0: read and compute in series); it is fitted from real passes, never assumed. A read-bound pass runs
past its read by about the same time whatever its compute (the last layer, the logits, the reader's
hand-offs); `benchmarks/pass_time.py` reports that tail beside the roofline.
"""

from dataclasses import asdict, dataclass, field, replace

import numpy as np

TERMS = ("fixed_s", "packed_s", "per_row_s", "per_prefill_token_s", "per_context_token_s", "per_product_s",
         "per_prefill_context_s")
CONTEXT_PASSES = 50   # decode-only passes before the refit prices context apart from the probe
CHUNK_PASSES = 5      # prompt passes scoring 2x the keys a token of the fewest do, before the refit prices keys


@dataclass
class PassShape:
    """What one pass carries."""
    decode_rows: int
    prefill_tokens: int
    context_tokens: int       # tokens of KV the decode rows attend to, summed over rows
    bytes_streamed: int
    prefill_groups: int = field(default=0, kw_only=True)   # prompts prefilling in groups, each its own attention
    prefill_context: int = field(default=0, kw_only=True)  # prompt tokens x the keys each scores
    columns: int = field(default=1, kw_only=True)          # tokens a decode row feeds (1 + its drafts, padded)

    @property
    def batched(self) -> bool:
        """More than one row through the matmuls: a matrix product, not a matrix-vector one."""
        return self.decode_rows + self.prefill_tokens > 1

    @property
    def extra_products(self) -> int:
        """Groups through the attention's weights beyond the first: the decode rows are one, each prefill group
        another (the MLP takes every group's tokens in one product where the family allows)."""
        return max(self.prefill_groups + (self.decode_rows > 0) - 1, 0)


@dataclass
class Observation(PassShape):
    """A pass the streamer ran, with its timings."""
    seconds: float = 0.0
    wait_s: float = 0.0        # compute thread blocked on the reader
    compute_s: float = 0.0     # layer math as the streamer timed it
    read_s: float = 0.0        # the reader's seconds in read calls (0: not reported)


@dataclass
class PassModel:
    bandwidth: float                  # bytes/s of the weight read
    fixed_s: float = 0.0
    packed_s: float = 0.0             # a product's cost beyond a single row's (a CPU BLAS packs every weight)
    per_row_s: float = 0.0
    per_prefill_token_s: float = 0.0
    per_context_token_s: float = 0.0
    per_product_s: float = 0.0        # another prefill group beside the decode rows (its attention, its products)
    per_prefill_context_s: float = 0.0   # a prompt token's attention to one key (cached, or of its chunk)
    overlap: float = 0.5              # before any pass: halfway between serial and perfect
    overhead_s: float = 0.0
    read_tail_s: float | None = None   # a read-bound pass's time past its read; None: (1 - overlap) x compute
    draft_s: float = 0.0              # a drafting pass's time beyond its padded shape's price (lookup, verification)

    def io_s(self, shape: PassShape) -> float:
        return shape.bytes_streamed / self.bandwidth

    def compute_s(self, shape: PassShape) -> float:
        return (self.fixed_s + self.packed_s * shape.batched + self.per_row_s * shape.decode_rows
                + self.per_prefill_token_s * shape.prefill_tokens
                + self.per_context_token_s * shape.context_tokens + self.per_product_s * shape.extra_products
                + self.per_prefill_context_s * shape.prefill_context)

    def roofline_s(self, shape: PassShape) -> float:
        """The ideal pass: the longer of IO and compute, everything else hidden."""
        return max(self.io_s(shape), self.compute_s(shape))

    def pass_s(self, shape: PassShape) -> float:
        return self._pass_s(shape) + (self.draft_s if shape.columns > 1 else 0.0)

    def _pass_s(self, shape: PassShape) -> float:
        io, c = self.io_s(shape), self.compute_s(shape)
        mixed = max(io, c) + (1.0 - self.overlap) * min(io, c)
        if self.read_tail_s is None or io <= 0:   # a pass that reads nothing has no read to run past
            return mixed + self.overhead_s
        # a pass computing past its read still runs its tail past the read: more compute never prices lower
        return (io + self.read_tail_s if io >= c else max(io + self.read_tail_s, mixed)) + self.overhead_s

    def prefill_allowance(self, bytes_streamed: int, decode_rows: int, context_tokens: int, offset: float = 0.0) -> int:
        """Prefill tokens a pass can carry while its compute stays under its weight-read time
        (at least 1, so a pass that is compute-bound already still makes progress); beside decode rows
        the prompts are at least one more product. `offset`: the prompt its tokens find cached, on average
        (their chunk's own keys are left out: the chunk is what this sizes)."""
        room = (bytes_streamed / self.bandwidth - self.fixed_s - self.packed_s - self.per_row_s * decode_rows
                - self.per_context_token_s * context_tokens - self.per_product_s * (decode_rows > 0))
        per_token = self.per_prefill_token_s + self.per_prefill_context_s * offset
        if per_token <= 0:
            return 1 << 30
        return max(1, int(room / per_token + 1e-9))

    def to_dict(self) -> dict:
        return asdict(self)


def read_rate(reads, least: int = 0) -> float | None:
    """The median bytes/s of (bytes, read seconds, compute seconds) of passes whose reads the streamer timed
    (of `least` bytes or more): of the read-bound ones where three were. Only a read-bound pass waits on its
    read, and reads between long computes run faster than reads back to back."""
    timed = [(b / r, r >= c) for b, r, c in reads if r and r > 0 and b and b >= least]
    bound = [rate for rate, longer in timed if longer]
    rates = bound if len(bound) >= 3 else [rate for rate, _ in timed]
    return float(np.median(rates)) if rates else None


def read_bound(p: Observation) -> bool:
    """A pass that waited on its weights: it read at least as long as it computed (where the reader timed its
    reads; before it did, it waited longer than it computed)."""
    return p.bytes_streamed > 0 and (p.read_s >= p.compute_s if p.read_s > 0 else p.wait_s > p.compute_s)


def read_tail(passes: list[Observation], overhead_s: float, least: int = 3) -> float | None:
    """The median time read-bound passes the reader timed ran past their reads, over `least` of them or more."""
    past = [p.seconds - overhead_s - p.read_s for p in passes if p.read_s > 0 and read_bound(p)]
    return max(float(np.median(past)), 0.0) if past and len(past) >= least else None


def _ridge(x: np.ndarray, y: np.ndarray, strength: float) -> np.ndarray:
    """Least squares of y on x's columns (each a multiple of the prior's term), pulled towards 1 with the
    weight of `strength` passes; no negative cost: a term fitted below zero is dropped, the rest refitted."""
    rms = np.sqrt(np.mean(x ** 2, axis=0))
    lam = np.sqrt(strength) * np.maximum(rms, 0.05 * np.sqrt(np.mean(y ** 2)) + 1e-12)
    a, b = np.vstack([x, np.diag(lam)]), np.concatenate([y, lam])
    w, free = np.zeros(x.shape[1]), np.ones(x.shape[1], dtype=bool)
    while free.any():
        w[:] = 0.0
        w[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
        if (w >= 0).all():
            break
        free &= w > 0
    return w


def fit(prior: PassModel, passes: list[Observation], older: list[Observation] = (),
        strength: float = 0.01) -> PassModel:
    """`refit`, then again with what drafting passes ran beyond their price (`draft_cost`) taken off their time:
    the other terms price what every pass does, `draft_s` what a drafting pass does besides."""
    model = refit(prior, passes, older, strength)
    draft_s = draft_cost(model, passes, prior.draft_s)
    if draft_s > 0 and any(p.columns > 1 for p in passes):
        def less(p: Observation) -> Observation:
            return replace(p, seconds=p.seconds - draft_s, wait_s=max(p.wait_s - draft_s, 0.0)) if p.columns > 1 else p
        model = refit(prior, [less(p) for p in passes], [less(p) for p in older], strength)
    model.draft_s = draft_s
    return model


def refit(prior: PassModel, passes: list[Observation], older: list[Observation] = (),
          strength: float = 0.01) -> PassModel:
    """Refit the compute terms, the overlap, the overhead and the bandwidth from observed passes (the compute
    terms from `older` ones too: a sample of those before, whose shapes the last ones may not have run).

    Compute: least squares of the streamer's compute_s on (1, batched, rows, prefill, context, products, prefill
    context), each term a multiple of the prior's, pulled towards the prior with the weight of `strength` passes
    (so a few passes cannot swing a term they do not exercise; context keeps the probe's price until
    CONTEXT_PASSES decode-only passes, a prompt token's keys until CHUNK_PASSES scored twice the fewest); with
    three decode-only passes or more, the decode terms from those alone and the prefill terms (tokens, products,
    keys) from what the others cost beyond them.
    Overhead: the median of what a pass spent outside waiting and computing. Overlap: the share of min(IO, compute) hidden,
    and what read-bound passes run past their reads (`read_tail_s`, where the reader timed three or more).
    Bandwidth: the rate of the reads inside passes where the streamer timed them (three passes or more; `read_rate`),
    else the probe's until three passes were read-bound (waited longer than they computed)."""
    if not passes:
        return prior
    # a term the prior leaves at zero (a stored calibration without it) is scaled like the fixed one,
    # a prompt token's cached context like a decode row's
    like = {"per_prefill_context_s": prior.per_context_token_s}
    prior_terms = np.array([getattr(prior, t) if getattr(prior, t) > 0 else max(like.get(t, prior.fixed_s), 1e-12)
                            for t in TERMS])
    every = list(older) + list(passes)
    raw = np.array([[1.0, p.batched, p.decode_rows, p.prefill_tokens, p.context_tokens, p.extra_products,
                     p.prefill_context] for p in every])
    x, y = raw * prior_terms, np.array([p.compute_s for p in every])
    # a term its passes cannot tell from the fixed one keeps the prior's price: packed without single-row
    # and batched passes both, per row over fewer than 4 rows of spread (1-row passes put 0.95 s on a row)
    # and context over fewer than CONTEXT_PASSES decode-only passes: a warm-up's few passes would put its price
    # on the rows
    decoding = (raw[:, 2] > 0) & (raw[:, 3] == 0)
    keys = raw[raw[:, 3] > 0, 6] / raw[raw[:, 3] > 0, 3]      # keys a prompt token scores, pass by pass
    frozen = [j for j, spread in ((1, np.ptp(raw[:, 1]) == 0), (2, np.ptp(raw[:, 2]) < 4),
                                  (4, decoding.sum() < CONTEXT_PASSES), (5, np.ptp(raw[:, 5]) == 0),
                                  (6, not keys.size or (keys >= 2 * keys.min()).sum() < CHUNK_PASSES)) if spread]
    priced = np.array([getattr(prior, t) for t in TERMS])
    target = y - raw[:, frozen] @ priced[frozen]
    x[:, frozen] = 0.0
    decode = x[:, 3] == 0
    if decode.sum() >= 3 and not decode.all():
        # decode-only passes price the decode terms; the prefill passes then price their tokens alone.
        # Fitted together, what a prefill pass costs beyond its tokens lands on whichever term moves with it
        dec = [0, 1, 2, 4]
        w = np.zeros(len(TERMS))
        w[dec] = _ridge(x[decode][:, dec], target[decode], strength)
        w[[3, 5, 6]] = _ridge(x[~decode][:, [3, 5, 6]], target[~decode] - x[~decode][:, dec] @ w[dec], strength)
    else:
        w = _ridge(x, target, strength)
    terms = w * prior_terms
    terms[frozen] = priced[frozen]
    model = PassModel(prior.bandwidth, *terms.tolist(), overlap=prior.overlap, overhead_s=prior.overhead_s,
                      read_tail_s=prior.read_tail_s, draft_s=prior.draft_s)
    seconds, y = np.array([p.seconds for p in passes]), y[len(every) - len(passes):]   # the last passes alone
    model.overhead_s = float(np.median([max(p.seconds - p.wait_s - p.compute_s, 0.0) for p in passes]))
    nbytes = np.array([p.bytes_streamed for p in passes], dtype=float)
    bound = np.array([read_bound(p) for p in passes])
    timed = (nbytes > 0) & np.array([p.read_s > 0 for p in passes])
    if timed.sum() >= 3:   # the reader timed its reads: the rate they ran at inside passes is the bandwidth
        model.bandwidth = read_rate((p.bytes_streamed, p.read_s, p.compute_s) for p in passes)
        tail = read_tail(passes, model.overhead_s)
        model.read_tail_s = model.read_tail_s if tail is None else tail
        bound[:] = False
    for _ in range(10):
        # a read-bound pass cannot tell a slow read from an unhidden one, so the overlap comes
        # from compute-bound passes where there are any, and the bandwidth from read-bound ones
        io = nbytes / model.bandwidth
        short, long_ = np.minimum(io, y), np.maximum(io, y)
        use = (y >= io) if (y >= io).any() else np.ones_like(y, dtype=bool)
        if short[use].sum() > 0:
            k = np.dot(short[use], (seconds - model.overhead_s - long_)[use]) / np.dot(short[use], short[use])
            model.overlap = float(np.clip(1.0 - k, 0.0, 1.0))
        if bound.sum() >= 3:   # reads the reader did not time: what the pass waited beyond its unhidden compute
            read_s = (seconds - model.overhead_s - (1.0 - model.overlap) * y)[bound]
            model.bandwidth = float(np.median(nbytes[bound] / np.maximum(read_s, 1e-9)))
    return model


def draft_cost(model: PassModel, passes: list[Observation], prior: float, least: int = 3) -> float:
    """What drafting passes ran beyond their price, less what plain ones did (the median of each, `least` of
    each at least; else `prior`): the work the padded shape does not show, lookup and verification among it."""
    drafting = [p.seconds - model._pass_s(p) for p in passes if p.columns > 1]
    plain = [p.seconds - model._pass_s(p) for p in passes if p.columns == 1]
    if len(drafting) < least or len(plain) < least:
        return prior
    return max(float(np.median(drafting) - np.median(plain)), 0.0)
