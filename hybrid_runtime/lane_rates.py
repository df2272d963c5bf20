"""What the scheduler knows about how fast each lane is, learned from the steps it ran.

The fluxion placement sizes the GPU lane's claims so both lanes finish a step together, and the
static placements split by the lanes' throughput ratio; both need current rates. Every estimate
starts from a prior and moves towards measurements, so a machine unlike the reference host is
learned within a few steps.
"""

from __future__ import annotations

# Weight of the newest measurement in the throughput estimates.
EMA = 0.3


class Throughput:
    """Modeled bytes per second of one lane (or one CPU worker): an exponential moving average."""

    def __init__(self, bytes_per_s: float, weight: float = EMA):
        self.bytes_per_s = bytes_per_s
        self.weight = weight

    def update(self, nbytes: float, seconds: float) -> None:
        """Fold in `nbytes` modeled bytes done in `seconds` busy time; empty samples are skipped."""
        if seconds > 0 and nbytes > 0:
            self.bytes_per_s += self.weight * (nbytes / seconds - self.bytes_per_s)


class OutlierClip:
    """Clips a sample above its limit (a JIT compile, a collection, an OS hiccup) unless `run` of
    them come in a row: then the machine really changed and the estimate must follow."""

    def __init__(self, run: int):
        self.run = run
        self._in_a_row = 0

    def __call__(self, sample: float, limit: float) -> float:
        if sample <= limit:
            self._in_a_row = 0
            return sample
        self._in_a_row += 1
        return limit if self._in_a_row < self.run else sample


class LaunchModel:
    """GPU launch time `lat + bytes / bw`, fitted online (least squares with exponential forgetting).

    One throughput number cannot size batches here: a launch has a fixed cost (planning the
    table, five kernels, the tail of the last wave) that dominates small batches, so the rate
    measured on small batches undersells large ones and vice versa.
    """

    def __init__(self, lat: float = 200e-6, bw: float = 10e9, forget: float = 0.9, link_bw: float | None = None):
        self.forget = forget
        self.lat, self.bw = lat, bw
        # The measured host-to-GPU link bandwidth (bytes/s) bounds the fitted rate: a fit above
        # it would be an artefact of the samples, never the machine. The model counts modeled
        # bytes (Eq. 3), which overstate what a launch reads (a group reads a block once for all
        # its heads), so the bound scales by the modeled/read ratio seen on this lane.
        self.link_bw = link_bw
        self.modeled_per_read = 1.0
        self._clip = OutlierClip(self.OUTLIER_RUN)
        # Two pseudo-observations encode the prior (lat, bw) at 1 MB and 64 MB; they fade as
        # real launches come in (a fit from launches of similar sizes alone is ill-conditioned).
        # Python floats, not a numpy array: an update runs on the launcher's critical path once
        # per GPU claim, and five scalars cost less host time as floats (measured with timeit: 9.8 vs
        # 3.9 us per update on the 2-core CI host).
        self._s = [0.0] * 5  # sum w, w*x, w*y, w*x*x, w*x*y  (x: MB, y: seconds)
        for mb in (1.0, 64.0):
            self._add(mb, lat + mb * 1e6 / bw, 1.0)

    def _add(self, x: float, y: float, w: float) -> None:
        s = self._s
        s[0] += w
        s[1] += w * x
        s[2] += w * y
        s[3] += w * x * x
        s[4] += w * x * y

    # A sample this many times the prediction is clipped (a JIT compile, an OS hiccup) unless
    # OUTLIER_RUN of them come in a row (then the machine really changed).
    OUTLIER = 2.0
    OUTLIER_RUN = 3

    def update(self, nbytes: float, seconds: float, bytes_read: float | None = None) -> None:
        """Fold in one launch: `nbytes` modeled bytes in `seconds`; `bytes_read`: what it really read."""
        if nbytes <= 0 or seconds <= 0:
            return
        if bytes_read:
            self.modeled_per_read += EMA * (nbytes / bytes_read - self.modeled_per_read)
        seconds = self._clip(seconds, self.OUTLIER * self.time(nbytes))
        f = self.forget
        self._s = [f * v for v in self._s]
        self._add(nbytes / 1e6, seconds, 1.0)
        s0, sx, sy, sxx, sxy = self._s
        den = s0 * sxx - sx * sx
        if den > 1e-12 * max(1.0, s0 * sxx):
            slope = (s0 * sxy - sx * sy) / den
            icpt = (sy - slope * sx) / s0
            if slope > 0:
                self.lat, self.bw = max(0.0, icpt), 1e6 / slope
                self._bound()
                return
        # Degenerate (equal sizes) or non-physical fit: keep the latency, refit the rate.
        self.bw = max(1e6, nbytes / max(seconds - self.lat, 0.1 * seconds))
        self._bound()

    def _bound(self) -> None:
        """Cap the rate at the link's; the latency is then the intercept at that slope."""
        if self.link_bw is None:
            return
        cap = self.link_bw * self.modeled_per_read
        if self.bw > cap:
            self.bw = cap
            s0, sx, sy = self._s[:3]
            self.lat = max(0.0, (sy - sx * 1e6 / cap) / s0)

    def time(self, nbytes: float) -> float:
        return self.lat + nbytes / self.bw


class Delay:
    """Seconds from a claim to the GPU starting it (or from a release to the first CPU task): an
    exponential moving average whose samples are clipped at `OUTLIER` times the estimate (and at
    least `FLOOR_S`) unless `OUTLIER_RUN` of them come in a row. One stalled start -- a collection,
    a compile, the stream busy with the caller's prefill -- would otherwise hold the estimate at
    milliseconds for several steps, and a fluxion claim pays the delay in its fixed cost, so the
    GPU lane would take nothing until it decays."""

    OUTLIER = 3.0
    FLOOR_S = 1e-3
    OUTLIER_RUN = 3

    def __init__(self, seconds: float, weight: float = EMA):
        self.seconds = seconds
        self.weight = weight
        self._clip = OutlierClip(self.OUTLIER_RUN)

    def update(self, seconds: float) -> None:
        seconds = self._clip(seconds, max(self.OUTLIER * self.seconds, self.FLOOR_S))
        self.seconds += self.weight * (seconds - self.seconds)


class LaneRates:
    """Everything one placement has learned about both lanes.

    Each placement keeps its own (the scheduler swaps them in `set_placement`): a placement's
    launches and task mix differ, and one placement's samples must not size another's claims.
    `cpu`: one CPU worker's rate over its busy time (static shares, reports); `cpu_lane`: the
    CPU lane's rate as a whole, modeled bytes over the time from its first task's start to its
    last task's end (idle workers, the tail, DRAM shared with the GPU's reads all included), and
    `cpu_start`: seconds from releasing the workers to their first task -- these two size the
    fluxion claims (they also count the tasks the workers hold, which the queue's rest does not);
    `gpu`: the GPU lane's average rate per launch (static shares, reports); `model`: the GPU
    launch model (fluxion claims), fitted on GPU time; `delay`: host time from a claim to the
    GPU starting it; `cpu_first`: seconds from the scheduler taking a step to its first CPU task
    (whatever ran before the release included: what a step on the GPU's selection and one that
    selects on the host are compared by, `GpuPicks.pays`).
    """

    def __init__(self, link_bw: float | None = None, n_cpu: int = 1):
        # Priors from the reference H100 host; measurements replace them within a few steps.
        self.cpu = Throughput(4e9)
        self.cpu_lane = Throughput(3e9 * max(1, n_cpu))
        self.cpu_start = Delay(300e-6)
        self.cpu_first = Delay(300e-6)
        # Fraction of a shared step's modeled bytes added to the GPU's first claim, learned from
        # how far apart the lanes finished (see `learn_balance`).
        self.balance = 0.0
        # The size (modeled bytes) of the steps that taught it: a moving average of their totals.
        self.balance_scale_bytes = 0.0
        # Shared steps in a row sized with these estimates that gave the GPU lane no claim
        # (`GpuLane.EXPLORE_AFTER`). Counted per set of estimates: steps sized with another set (a
        # step on the GPU's selection, or one that selects on the host) must not keep this set
        # from being re-measured.
        self.unclaimed_steps = 0
        self.gpu = Throughput(30e9)
        self.model = LaunchModel(lat=100e-6, bw=45e9, link_bw=link_bw)
        self.delay = Delay(200e-6)

    def snapshot(self) -> dict:
        """What these estimates would size the next claim with, in reporting units (GB/s, us):
        a report reads it before and after a run to see what the run's first steps were sized by."""
        return {
            "cpu_lane_GBps": self.cpu_lane.bytes_per_s / 1e9,
            "cpu_worker_GBps": self.cpu.bytes_per_s / 1e9,
            "cpu_start_us": self.cpu_start.seconds * 1e6,
            "cpu_first_us": self.cpu_first.seconds * 1e6,
            "gpu_GBps": self.gpu.bytes_per_s / 1e9,
            "gpu_launch_lat_us": self.model.lat * 1e6,
            "gpu_launch_GBps": self.model.bw / 1e9,
            "gpu_modeled_per_read": self.model.modeled_per_read,
            "gpu_claim_delay_us": self.delay.seconds * 1e6,
            "balance": self.balance,
            "balance_scale_MB": self.balance_scale_bytes / 1e6,
            "unclaimed_steps": self.unclaimed_steps,
        }

    # Weight of one step's imbalance in `balance`, and its bound.
    BALANCE_GAIN = 0.5
    BALANCE_LIMIT = 0.5

    def learn_balance(self, cpu_end: float, gpu_end: float, total_bytes: float, excess_bytes: float = 0.0) -> None:
        """Fold in one shared step's outcome: the CPU lane finished at `cpu_end`, the GPU lane at
        `gpu_end` (host seconds). Moving x bytes to the GPU would have ended both together when
        `x = (cpu_end - gpu_end) / (1/bw + 1/tp_c)`. The lane models size claims from rates,
        delays and fixed costs that each carry some error (modeled vs read bytes, the selection's
        share of a claim, host noise); `balance` learns what is systematic in their sum, as a
        fraction of the step's bytes.

        `excess_bytes`: how many modeled bytes the claim took beyond what the models (with the
        balance) asked for -- a claim is whole queue positions, and a re-measuring claim takes one
        where they asked for none. The claim that would have ended both lanes together is
        `claimed + x`, so the balance moves towards asking for that: by `x + excess_bytes`. Without
        the excess, a step whose ideal claim is below one position would teach the balance the
        rounding (the GPU lane, given a whole position, ends late) and keep the lane out for good.
        """
        if total_bytes <= 0:
            return
        x = (cpu_end - gpu_end) / (1.0 / self.model.bw + 1.0 / self.cpu_lane.bytes_per_s)
        b = self.balance + self.BALANCE_GAIN * (x + excess_bytes) / total_bytes
        self.balance = min(self.BALANCE_LIMIT, max(-self.BALANCE_LIMIT, b))
        scale = self.balance_scale_bytes
        self.balance_scale_bytes = total_bytes if scale <= 0.0 else scale + self.BALANCE_GAIN * (total_bytes - scale)

    def balance_bytes(self, total_bytes: float) -> float:
        """The learned correction to a step's first claim, in modeled bytes: `balance` of the step,
        but of no more bytes than the steps it was learned on. A fraction learned on short steps
        (fixed costs and one position's rounding dominate them) says nothing about a step many
        times their size: measured, a 1K-token warm-up left it at -0.5 and the first step of a
        32K prompt gave the GPU lane 1-2% of its bytes against ~30% from the second step on
        (benchmarks/notes/gpu_lane.md section 32)."""
        return self.balance * min(total_bytes, self.balance_scale_bytes)


__all__ = ["EMA", "Delay", "LaneRates", "LaunchModel", "OutlierClip", "Throughput"]
