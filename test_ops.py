"""Every op of the `kernels` extension proven against its PyTorch twin, forward and backward.

    python test_ops.py                          # all cases; GPU cases are skipped without CUDA
    python test_ops.py --only attention         # the cases whose name contains 'attention'
    python test_ops.py --gpu_only --shard 0/3   # GPU cases 0, 3, 6, ... (parallel sanitizer runs)
    python test_ops.py --sanitize               # every GPU case under compute-sanitizer's four tools
    python test_ops.py --bench [--json PATH]    # speed against PyTorch (needs a GPU and the build)
    python test_ops.py --bench --only attention_bf16   # one bench table (names as in --only)
    python test_ops.py --mutants                # plant known faults: each must fail the cases that guard it
    python test_ops.py --toc                    # renumber kernels.cu's table of contents

Each case prints one line. A numeric check reads `label max|ours - ref|/tolerance`, where a
tolerance `a+r|ref|` allows a + r * |ref| per element. References run in float64 where that
sharpens the check, so the error shown is ours alone. The data.py tests run here too, on CPU.
"""

import argparse
import collections
import contextlib
import copy
import fcntl
import functools
import hashlib
import http.server
import io
import itertools
import json
import math
import multiprocessing
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import string
import subprocess
import sys
import tempfile
import threading
import time
import types
import unittest.mock
import warnings
import zipfile
import zlib

import torch
import torch.nn.functional as F

import data
import inference
import mhc
import train

try:
    import kernels
    KERNELS_ERROR = None
except Exception as e:  # ImportError without a build; a stale build can fail in other ways
    kernels, KERNELS_ERROR = None, e

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda"
HERE = os.path.dirname(os.path.abspath(__file__))  # the repo: the scripts run from here
BUILD_HINT = "build it with: python setup.py build_ext --inplace"


# This file: the machinery first (runner, mutants, sanitizer, the inputs and checks the ops share, and the
# registries an op's block adds to: bad inputs, opcheck arguments, bench rows), then one block per op, headed
# "# ==== op: <names> ====", with everything about that op at both dtypes; then the cases across the ops, the
# scripts' tests and main.


# ==== the PyTorch twins ====
# the PyTorch twin of every op, same signatures as `kernels`; an op's own reference helpers are in
# its block


# The torch op set of train.py, the one the model trains with, is the reference. The tests pass
# kernels-only options (mode, precision) to both sides; the twin has nothing to choose there.
REF = types.SimpleNamespace(**vars(train.TORCH_OPS))
# Set in processes that compute-sanitizer runs: tests that cannot run under it skip, saying why.
UNDER_SANITIZER = any(k.startswith("NV_SANITIZER") for k in os.environ)


def under_tool(normal, shorter):
    """The length of an end-to-end case (steps, tokens): shorter under a tool, which checks every launch of
    a kernel; a step's tenth replay launches nothing its first did not, and the tool slows each many times."""
    return shorter if UNDER_SANITIZER else normal


def past_grid_limit():
    """Skips a case whose launches go past a grid dimension's 65535 blocks (grid.y, grid.z) under a sanitizer:
    it checks every one of their millions of blocks (the same kernels run at ordinary sizes there)."""
    if UNDER_SANITIZER:
        raise Skip("past a grid dimension's 65535 blocks: millions of blocks, too slow under a sanitizer")


if UNDER_SANITIZER:
    # synccheck reports barrier errors inside cuDNN's bf16 attention backward, whose call then fails and
    # leaves the CUDA context broken for every later case of the process; the bf16 training cases, whose
    # torch op set reaches it, did not finish under memcheck either. SDPA's other backends compute the
    # same function, for the twins and the torch op set alike.
    torch.backends.cuda.enable_cudnn_sdp(False)


# ==== runner ====


CASES = []   # (name, fn, needs_gpu)
CHECKS = []  # "label err/tol" of each check the running case passed


class Skip(Exception):
    pass


def add(name, fn, *args, gpu=True, **kwargs):
    CASES.append((name, functools.partial(fn, *args, **kwargs), gpu))


def one_line(e):
    return " ".join(str(e).split())[:400]


def check(label, ours, ref, tol):
    """|ours - ref| <= atol + rtol * |ref| everywhere; tol is atol or (atol, rtol)."""
    atol, rtol = tol if isinstance(tol, tuple) else (tol, 0.0)
    tol_text = f"{atol:.2g}" + (f"+{rtol:.0e}|ref|" if rtol else "")
    assert ours.shape == ref.shape, f"{label}: shape {tuple(ours.shape)}, reference {tuple(ref.shape)}"
    ours, ref = ours.detach().double(), ref.detach().double().to(ours.device)
    diff = (ours - ref).abs()
    err = diff.max().item() if diff.numel() else 0.0
    bad = ~(diff <= atol + rtol * ref.abs())  # NaN is bad
    if bad.any():
        at = tuple(torch.nonzero(bad)[0].tolist())
        raise AssertionError(f"{label}: max|err| {err:.2e} > {tol_text}; first at {at}: "
                             f"ours {ours[at].item():.6g}, reference {ref[at].item():.6g}")
    CHECKS.append(f"{label} {err:.1e}/{tol_text}")


def check_nonfinite(label, ours, ref, tol):
    """ours is NaN, +inf and -inf exactly where ref is, and within tol of it everywhere else (check)."""
    assert ours.shape == ref.shape, f"{label}: shape {tuple(ours.shape)}, reference {tuple(ref.shape)}"
    ours, ref = ours.detach().double(), ref.detach().double().to(ours.device)
    for what, f in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        if not torch.equal(f(ours), f(ref)):
            at = tuple(torch.nonzero(f(ours) != f(ref))[0].tolist())
            raise AssertionError(f"{label}: {what} at {f(ours).sum().item()} elements, the reference at "
                                 f"{f(ref).sum().item()}; first differing at {at}: ours {ours[at].item():.6g}, "
                                 f"reference {ref[at].item():.6g}")
    finite = ref.isfinite()
    check(label, ours[finite], ref[finite], tol)


def outputs(out):
    """An op's result as a tuple of (label, tensor): ('out', out), or ('out0', ..), ('out1', ..) for a tuple."""
    return (("out", out),) if torch.is_tensor(out) else tuple((f"out{i}", t) for i, t in enumerate(out))


def compare(f, tol, grad_tol=None, dy=None, unreached=(), nonfinite=False, **inputs):
    """f(kernels, **inputs) in fp32 against f(REF, **inputs) on float64 copies; f may return a tuple, each
    output checked. Given grad_tol (one for all, or by input name), one dy per output (random unless
    given) goes back through both autograds and every float input's gradient is checked too; unreached names
    the inputs the loss does not depend on (an unused output's): their gradient must be zeros or none. Float32
    inputs and dy reach our op as they are (same memory, same strides and offset); the reference gets
    float64 copies. nonfinite: NaN and inf are expected, each where the reference has them (check_nonfinite)."""
    check_of = check_nonfinite if nonfinite else check
    def leaves(dtype):
        return {n: t.detach().to(dtype).requires_grad_(grad_tol is not None)
                if t is not None and t.is_floating_point() else t for n, t in inputs.items()}
    ours_in, ref_in = leaves(torch.float32), leaves(torch.float64)
    outs, refs = outputs(f(kernels, **ours_in)), outputs(f(REF, **ref_in))
    for (label, out), (_, ref) in zip(outs, refs, strict=True):
        assert out.dtype == torch.float32, f"{label} dtype {out.dtype}, expected float32"
        check_of(label, out, ref, tol)
    if grad_tol is None:
        return
    # drawn by shape: an output's memory layout (attention's is (B, S, H, D)) must not change it
    dys = [torch.randn(out.shape, device=out.device) for _, out in outs] if dy is None else [dy]
    for (label, out), d in zip(outs, dys, strict=True):
        assert d.shape == out.shape, f"dy {tuple(d.shape)} for {label} of {tuple(out.shape)}"
    torch.autograd.backward([out for _, out in outs], dys)
    torch.autograd.backward([ref for _, ref in refs], [d.double() for d in dys])
    for n, t in ours_in.items():
        if t is None or not t.is_floating_point():
            continue
        ref_grad = ref_in[n].grad
        if n in unreached:
            assert ref_grad is None, f"the reference's loss depends on {n}, named unreached"
            if t.grad is None:
                continue
            ref_grad = torch.zeros_like(ref_in[n])
        assert t.grad is not None, f"no gradient reached {n}"
        assert ref_grad is not None, f"no gradient reached {n} in the reference"
        check_of("d" + n, t.grad, ref_grad, grad_tol[n] if isinstance(grad_tol, dict) else grad_tol)


def run_case(name, fn, gpu):
    torch.manual_seed(zlib.crc32(name.encode()))
    CHECKS.clear()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            note = fn()
            if gpu:
                torch.cuda.synchronize()  # a kernel fault belongs to the case that launched it
                kernels.check_errors()    # and so does a bad index a kernel met
    except Skip as e:
        return "SKIP", str(e)
    except (Exception, SystemExit) as e:  # SystemExit: a script's fail() called in-process ends the case, not the run
        if gpu:
            with contextlib.suppress(Exception):
                kernels.check_errors()  # leave no pending index error to the next case
        return "FAIL", "  ".join(CHECKS + [f"{type(e).__name__}: {one_line(e)}"])
    return "PASS", "  ".join(CHECKS + ([note] if note else []))


def run_tests(only, gpu_only=False, shard=(0, 1), skip=frozenset()):
    cases = [c for c in CASES if only in c[0] and (c[2] or not gpu_only)]
    if gpu_only:
        print(f"--gpu_only: {sum(only in c[0] and not c[2] for c in CASES)} CPU cases not run")
    if skip:
        print(f"--skip_file: {sum(c[0] in skip for c in cases)} cases passed in an earlier run, not run again")
        cases = [c for c in cases if c[0] not in skip]
    if shard[1] > 1:  # every n-th case, so parallel shards share the slow cases out evenly
        print(f"--shard {shard[0]}/{shard[1]}: {len(cases[shard[0]::shard[1]])} of {len(cases)} cases")
        cases = cases[shard[0]::shard[1]]
    gpu_verdict = None
    if not HAS_CUDA:
        print(f"no CUDA device (torch {torch.__version__}): GPU cases are skipped")
        gpu_verdict = ("SKIP", "no CUDA device")
    elif kernels is None:
        print(f"CUDA device present but `import kernels` failed ({one_line(KERNELS_ERROR)}); {BUILD_HINT}")
        gpu_verdict = ("FAIL", "kernels not built")
    else:
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
    record = open(VERDICTS, "w") if VERDICTS else contextlib.nullcontext()
    for name, fn, gpu in cases:
        print(f"{name:<46} ", end="", flush=True)  # before the case: a slow one shows what is running
        t0 = time.perf_counter()
        status, detail = gpu_verdict if gpu and gpu_verdict else run_case(name, fn, gpu)
        seconds = time.perf_counter() - t0
        counts[status] += 1
        again = f"\n{name:<46} " if UNDER_SANITIZER else ""  # a tool's reports may sit between name and verdict
        print(f"{again}{status}  {detail}" + (f"  ({seconds:.1f} s)" if seconds >= 1 else ""), flush=True)
        if VERDICTS:
            record.write(json.dumps([name, status, detail]) + "\n")
    if VERDICTS:
        record.close()
    if not cases:
        print(f"no case name contains {only!r}")
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return 1 if counts["FAIL"] or not cases else 0


# ==== mutants ====
# --mutants: a test proves something only if it can fail. Each mutant plants one fault (a no-op cache
# write, a slide that keeps one token, greedy in place of sampling, ...) and names the cases that must
# catch it; the run checks that each of them passes on the real code and fails with the fault planted.

MUTANTS = []  # (name, plant: a context manager factory, names of the cases that must catch it)
# A file where a test run writes each case's verdict, which a later --mutants run takes as the real code's
# instead of running the catchers again (CI: the test run just before, on the same checkout).
VERDICTS = os.environ.get("TEST_OPS_VERDICTS")


def mutant(name, *catchers):
    """Registers the decorated generator function, which plants a fault while it is suspended, as mutant
    `name`, caught by every case in catchers."""
    def register(fn):
        MUTANTS.append((name, contextlib.contextmanager(fn), catchers))
        return fn
    return register


def case_named(name):
    found = [c for c in CASES if c[0] == name]
    assert len(found) == 1, f"--mutants: {len(found)} cases named {name!r}"
    return found[0]


def run_mutant(name, plant, catchers, clean):
    """'caught by ...', 'NOT CAUGHT (...)' or 'skipped (...)' for one mutant; clean caches each catcher's
    verdict on the real code, run first: a case that fails there would catch any fault. A catcher that
    skips there (a GPU case without a GPU) is named and left out; the others must catch the fault."""
    verdicts, skipped = [], []
    for case in map(case_named, catchers):
        if case[0] not in clean:
            clean[case[0]] = run_case(*case) if not case[2] or (HAS_CUDA and kernels) else ("SKIP", "no GPU build")
        status, detail = clean[case[0]]
        if status == "SKIP":
            skipped.append((case[0], detail[:80]))
            continue
        if status != "PASS":
            return f"NOT CAUGHT ({case[0]} {status.lower()}s on the real code: {detail[:160]})"
        with plant():
            verdicts.append((case[0],) + run_case(*case))
    skips = f"{', '.join(n for n, _ in skipped)} skip on the real code: {skipped[0][1]}" if skipped else ""
    if not verdicts:
        return f"skipped ({skips})"
    missed = [n for n, status, _ in verdicts if status != "FAIL"]
    if missed:
        return f"NOT CAUGHT (passed with the fault: {', '.join(missed)})"
    first = one_line(verdicts[0][2].rsplit("  ", 1)[-1])[:140]
    return f"caught by {', '.join(n for n, _, _ in verdicts)}: {first}" + (f" ({skips})" if skips else "")


def run_mutants(only):
    chosen = [m for m in MUTANTS if only in m[0]]
    print(f"{len(chosen)} mutants" + (f" whose name contains {only!r}" if only else "") +
          ("" if HAS_CUDA and kernels else "; GPU cases among the catchers are skipped (no CUDA device or no build)"))
    clean, counts = {}, collections.Counter()
    if VERDICTS and os.path.exists(VERDICTS):
        with open(VERDICTS) as f:
            clean = {name: (status, detail) for name, status, detail in map(json.loads, f)}
        print(f"the real code's verdicts: {len(clean)} cases of the test run that wrote {VERDICTS}")
    for name, plant, catchers in chosen:
        verdict = run_mutant(name, plant, catchers, clean)
        counts[verdict.split(" ")[0]] += 1
        print(f"mutant {name}: {verdict}", flush=True)
    print(f"{counts['caught']} caught, {counts['NOT']} not caught, {counts['skipped']} skipped")
    return 1 if counts["NOT"] or not chosen else 0


# ==== sanitizer ====
# --sanitize: every GPU case under compute-sanitizer's four tools, then what each tool reported, split
# into reports inside this repo's kernels (their frames name kernels.cu: the build keeps line info) and
# reports inside PyTorch's, cuBLAS's and cuDNN's kernels, which the cases run as twins and references.
# memcheck, racecheck and synccheck instrument only this repo's kernels (kernel_filter): PyTorch's, cuBLAS's
# and cuDNN's, which the cases run as twins and references, run natively, so a sweep takes minutes, not
# hours. --filter none instruments every kernel.

SANITIZER_TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")


def our_kernel_names():
    """The __global__ function names in kernels.cu, for compute-sanitizer's --kernel-name filter."""
    source = open(os.path.join(HERE, "kernels.cu")).read()
    return sorted(set(re.findall(r"__global__\s+void\s+(?:__launch_bounds__\((?:[^()]|\([^()]*\))*\)\s+)?(\w+)",
                                 source)))


def kernel_filter(tool):
    """compute-sanitizer options that leave kernels not in kernels.cu uninstrumented. initcheck gets none:
    memory an uninstrumented kernel wrote reads as uninitialised to it. racecheck gets none: under any
    kernel-name filter (ours only, ours and cuBLAS's, all but the libraries' GEMMs) cublasCreate fails
    (CUBLAS_STATUS_NOT_INITIALIZED) and the bf16 matmul case meets "failed to handle a hardware exception".
    The names match as substrings, so PyTorch's elementwise_kernel is instrumented too."""
    if tool in ("initcheck", "racecheck"):
        return []
    return ["--kernel-name", "regex=" + "|".join(our_kernel_names())]


def tool_cases(tool, names):
    """The cases a tool runs. initcheck leaves out the bf16 ones: their matmul outputs are written by the
    copy engine (cp.async.bulk.tensor), whose stores initcheck does not follow, so every later read of them,
    in our kernels too, is reported as uninitialised (a 64 x 64 tile stored by cp.async.bulk.tensor shows it).
    racecheck leaves out the bf16 op-set comparisons: 10 steps of the torch op set's bf16 training (PyTorch's
    kernels, cuDNN's attention) take racecheck to 160 GB of host memory, and where memory runs short the
    process is killed with no report; our op set's bf16 training alone takes 34 GB (`compute-sanitizer
    --tool racecheck python train.py --dtype=bf16 --backend=cuda`)."""
    if tool == "initcheck":
        return [n for n in names if "bf16" not in n]
    if tool == "racecheck":
        return [n for n in names if not n.startswith("train/gpu_bf16_op_sets_close")]
    return list(names)


def sanitizer_logs(log_dir, tool):
    """tool's logs in log_dir, oldest run first: tool_0.log, tool_1.log, ..."""
    logs = [f for f in os.listdir(log_dir) if re.fullmatch(rf"{tool}_\d+\.log", f)]
    return [os.path.join(log_dir, f) for f in sorted(logs, key=lambda f: int(re.search(r"(\d+)\.log", f).group(1)))]


TEST_SUMMARY = r"\d+ passed, \d+ failed, \d+ skipped"


def case_verdicts(logs):
    """{case: PASS, FAIL, SKIP or DIED} over logs, the later log's verdict where a case ran twice. DIED: the
    case a log ends in, with no verdict and no test summary after it (its process was killed or crashed)."""
    verdicts = {}
    for log in logs:
        text = open(log, errors="replace").read()
        verdicts.update(re.findall(r"^(\S+)\s+(PASS|FAIL|SKIP)\b", text, re.M))
        started = list(re.finditer(r"^(\S+/\S+) +(?:=========.*)?$", text, re.M))  # a case's name, no verdict
        if started and not re.search(TEST_SUMMARY, text) and \
                not re.search(rf"^{re.escape(started[-1].group(1))}\s+(PASS|FAIL|SKIP)\b", text[started[-1].end():], re.M):
            verdicts[started[-1].group(1)] = "DIED"
    return verdicts


def sources_digest():
    """kernels.cu's and bindings.cpp's code, less comments and blank lines: what a sanitizer log checked."""
    code = []
    for f in ("kernels.cu", "bindings.cpp"):
        code += [line.split("//")[0].strip() for line in open(os.path.join(HERE, f), encoding="utf-8")]
    return hashlib.sha256("\n".join(line for line in code if line).encode()).hexdigest()


def check_sanitizer_logs_match(log_dir):
    """Logs resume only over the code they checked: log_dir/sources holds sources_digest(); another digest
    means other kernels, whose cases start over in another directory (a comment's edit changes nothing)."""
    digest = sources_digest()
    stamp = os.path.join(log_dir, "sources")
    if os.path.exists(stamp) and open(stamp).read().strip() != digest:
        sys.exit(f"--log_dir {log_dir}: its logs are of another kernels.cu or bindings.cpp; give a new --log_dir")
    with open(stamp, "w") as f:
        f.write(digest + "\n")


def sanitize(tools, shards, only, log_dir, filtered=True):
    """Runs `shards` processes a tool, all at once, each over every shards-th GPU case; logs in log_dir.
    The processes take the visible GPUs in turn. filtered: instrument only the kernels of kernels.cu where
    the tool allows it (kernel_filter). A run resumes the logs already in log_dir: a case that passed or
    skipped there is not run again."""
    os.makedirs(log_dir, exist_ok=True)
    check_sanitizer_logs_match(log_dir)
    expected = [c[0] for c in CASES if c[2] and only in c[0]]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    runs = []
    for tool in tools:
        for name, cmd, log in sanitizer_commands(tool, kernel_filter(tool) if filtered else [], shards, only, log_dir,
                                                 expected):
            runs.append((name, *start_logged(cmd, log, gpus[len(runs) % len(gpus)] if gpus else None)))
    print(f"{len(runs)} processes over {max(1, len(gpus))} GPU(s), logs in {log_dir}", flush=True)
    try:
        for name, proc, thread, t0 in runs:
            thread.join()
            print(f"  {name} done in {time.time() - t0:.0f} s (exit {proc.wait()})", flush=True)
    except KeyboardInterrupt:
        print("interrupted: the logs so far (a later run with this --log_dir resumes them)")
        for _, proc, thread, _ in runs:
            proc.terminate()
            thread.join()
    return print_sanitizer_summary(log_dir, expected)


def sanitizer_commands(tool, options, shards, only, log_dir, expected):
    """(name, command, log) of each process that runs tool's cases not yet done in log_dir: `shards` of them
    share the cases, and a case its process died in (DIED) gets a process of its own, so that dying again
    takes no other case with it. The processes skip what the files log_dir/<tool>.*.skip name."""
    logs, cases = sanitizer_logs(log_dir, tool), tool_cases(tool, expected)
    verdicts = case_verdicts(logs)
    done = {name for name, verdict in verdicts.items() if verdict in ("PASS", "SKIP")}
    died = sorted(name for name, verdict in verdicts.items() if verdict == "DIED" and name in cases)
    left = len(set(cases) - done)
    print(f"{tool}: {left} cases to run ({len(cases) - left} done in earlier runs, {len(expected) - len(cases)} "
          f"left out{f', {len(died)} alone' if died else ''}), instrumenting {options[1] if options else 'every kernel'}")
    if not left:
        return []

    def skip_file(label, names):
        path = os.path.join(log_dir, f"{tool}.{label}.skip")
        with open(path, "w") as f:
            f.write("".join(name + "\n" for name in sorted(names)))
        return path
    command = ["compute-sanitizer", "--tool", tool, "--print-limit", "0", "--show-backtrace", "device", *options,
               sys.executable, __file__, "--gpu_only", "--only", only]
    shared = skip_file("shared", done | (set(expected) - set(cases)) | set(died))
    commands = [command + ["--shard", f"{k}/{shards}", "--skip_file", shared] for k in range(shards)] \
        if left > len(died) else []
    commands += [command + ["--skip_file", skip_file(f"alone{i}", set(expected) - {name})] for i, name in enumerate(died)]
    first = 1 + max((int(re.search(r"_(\d+)\.log$", f).group(1)) for f in logs), default=-1)
    return [(f"{tool}_{first + k}", cmd, os.path.join(log_dir, f"{tool}_{first + k}.log")) for k, cmd in enumerate(commands)]


def start_logged(cmd, log, gpu=None):
    """Starts cmd (on GPU number gpu, if given) with its output going through keep_sanitizer_log to log:
    (process, thread, start time). One CPU thread a process (unless OMP_NUM_THREADS says otherwise): a
    sweep runs dozens of them, each of whose thread pools would otherwise take every core."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                            env=env)
    thread = threading.Thread(target=keep_sanitizer_log, args=(proc, log), daemon=True)
    thread.start()
    return proc, thread, time.time()


SANITIZER_KEEP = 20  # reports written out per kernel and log; the rest are only counted
SANITIZER_QUIET = ("COMPUTE-SANITIZER", "ERROR SUMMARY", "RACECHECK SUMMARY", "Target application returned")


def keep_sanitizer_log(proc, path):
    """Copies proc's output to path, all but the reports past SANITIZER_KEEP of one kernel (initcheck can
    report 100,000 reads a case), and ends the log with a tally line per kernel."""
    tally, block = {}, []

    def close_block(log):
        for ours, where, _ in sanitizer_reports("".join(block)):
            tally[(ours, where)] = tally.get((ours, where), 0) + 1
            if tally[(ours, where)] <= SANITIZER_KEEP:
                log.writelines(block)

    with open(path, "w") as log:
        for line in proc.stdout:
            if line.startswith("=========     "):
                block.append(line)
                continue
            if block:
                close_block(log)
            opens = line.startswith("========= ") and line[10:].strip() and not line[10:].startswith(SANITIZER_QUIET)
            block = [line] if opens else []
            if not block and line.strip() != "=========":  # the tool's blank separator lines
                log.write(line)
                log.flush()
        if block:
            close_block(log)
        for (ours, where), n in tally.items():
            log.write(f"TALLY {'ours' if ours else 'other'} {n} {where}\n")


def sanitizer_reports(text):
    """(ours, where, message) for each report in a compute-sanitizer log: a line '========= X' opens one,
    the indented '=========     ...' lines under it give its frames."""
    reports, block = [], []
    for line in text.splitlines() + ["========= "]:
        if not line.startswith("========= "):
            continue
        body = line[len("========= "):]
        if body.startswith("    "):
            block.append(body.strip())
            continue
        if block:
            frames = " ".join(block).split("Saved host backtrace")[0]  # the device side only
            at = re.search(r"\bat (.+?)(?:\+0x| in |$)", frames)
            name = at.group(1).removeprefix("void ").replace("(anonymous namespace)", "") if at else ""
            where = re.split(r"[<(]", name)[0].split("::")[-1] or block[0][:80]
            reports.append(("kernels.cu" in frames, where, block[0][:80]))
        block = [body] if body.strip() and not body.startswith(SANITIZER_QUIET) else []
    return reports


def print_sanitizer_summary(log_dir, expected=None):
    """One row per tool: cases, those of `expected` (case names) that no log gives a verdict for, the
    tool's own summary, reports in our kernels and elsewhere."""
    failed_any = False
    print(f"\n{'tool':<10} {'cases':>5} {'pass':>5} {'fail':>4} {'skip':>4} {'missing':>7}  {'ours':>5} "
          f"{'other':>6}  tool's summaries")
    for tool in SANITIZER_TOOLS:
        logs = sanitizer_logs(log_dir, tool)
        if not logs:
            continue
        cases = tool_cases(tool, expected) if expected is not None else []
        by_case = case_verdicts(logs)
        if expected is not None:  # a verdict logged before its case was left out of the tool does not count
            by_case = {name: verdict for name, verdict in by_case.items() if name in cases}
        verdicts = list(by_case.values())
        counts = [verdicts.count(v) for v in ("PASS", "FAIL", "SKIP")]
        counts[1] += verdicts.count("DIED")
        missing = [name for name in cases if name not in by_case]
        sums, ours, other, notes, unfinished = [], [], {}, [], []
        if expected is not None and len(cases) < len(expected):
            notes.append(f"{len(expected) - len(cases)} cases left out (tool_cases)")
        for path in logs:
            f, text = os.path.basename(path), open(path, errors="replace").read()
            died = [name for name, verdict in case_verdicts([path]).items() if verdict == "DIED"]
            if died and by_case.get(died[0]) == "DIED":
                notes.append(f"{f}: {died[0]} DIED: its process ended inside it (killed or crashed), no verdict")
            elif not died and not re.search(TEST_SUMMARY, text):
                unfinished.append(f)
            sums += re.findall(r"(?:ERROR|RACECHECK) SUMMARY: (\d+ \w+)", text)
            notes += [f"{f}: {m.group(1)} {m.group(2)}: {m.group(3)[:100]}"
                      for m in re.finditer(r"^(\S+)\s+(FAIL|SKIP)\s+(.*)$", text, re.M)]
            tallies = re.findall(r"^TALLY (ours|other) (\d+) (.*)$", text, re.M)  # a finished log
            reports = [(o == "ours", w, int(n)) for o, n, w in tallies] or \
                [(o, w, 1) for o, w, _ in sanitizer_reports(text)]
            for is_ours, where, n in reports:
                if is_ours:
                    ours.append((n, where))
                else:
                    other[where] = other.get(where, 0) + n
        if unfinished:
            notes.insert(0, f"no test summary in {', '.join(unfinished)} (still running, killed or crashed)")
        failed_any |= bool(ours) or counts[1] > 0 or bool(missing)
        print(f"{tool:<10} {sum(counts):>5} {counts[0]:>5} {counts[1]:>4} {counts[2]:>4} "
              f"{len(missing) if expected is not None else '-':>7}  {sum(n for n, _ in ours):>5} "
              f"{sum(other.values()):>6}  {', '.join(sums)}")
        for n, where in ours[:20]:
            print(f"    OURS  {n} in {where}")
        for where, n in sorted(other.items(), key=lambda kv: -kv[1])[:8]:
            print(f"    other {n:>6} in {where}")
        for note in notes:
            print(f"    {note}")
    return 1 if failed_any else 0


# ==== inputs and checks shared by the ops ====
# Inputs are unit normals unless a case says otherwise; tolerances are absolute against the float64
# reference, (atol, rtol) where outputs span many magnitudes.


def rand(*shape, scale=1.0):
    return torch.randn(*shape, device=DEV) * scale


def misaligned(*shape):
    """Unit normals in a contiguous view that starts one float into its allocation, so its data pointer
    is not 16-byte aligned: 16-byte loads of it need a copy or the scalar path. Checked here, so a
    case built on it cannot become an aligned one unnoticed."""
    t = rand(1 + math.prod(shape))[1:].view(*shape)
    assert t.data_ptr() % 16, f"misaligned({shape}) is 16-byte aligned"
    return t


def mm_tol(*dims):
    # rounding in an fp32 dot product grows with its length; 1e-4*sqrt(n) leaves room for any fp32
    # summation order yet catches TF32 slipping in (~1e-3*sqrt(n)) and any indexing slip (O(1))
    return 1e-4 * math.sqrt(max(dims))


# bf16 row ops: bf16 activations in and out, fp32 arithmetic inside (mixed-precision training feeds the
# norms fp32 and asks for bf16 out; bf16 inference is bf16 throughout). Held to the fp32 tolerances of
# each op plus one bf16 rounding (2^-8 relative) wherever the checked tensor is bf16, and, as the bf16
# matmul, to at most twice PyTorch's own error (its twin on the same dtypes) plus that atol.
BF16 = torch.bfloat16


def bf16_tolerance(dtype, tol):
    atol, rtol = tol if isinstance(tol, tuple) else (tol, 0.0)
    return (atol, max(rtol, 2**-8)) if dtype == BF16 else (atol, rtol)


def on_both(f):
    """f(ops, **inputs) as compare_dtypes' (ours, torch_fn) pair: the call stated once, on kernels and on its
    twins (REF, train.TORCH_OPS)."""
    return functools.partial(f, kernels), functools.partial(f, REF)


def compare_dtypes(ours, torch_fn, tol, grad_tol=None, out_dtype=BF16, ref_fn=None, **inputs):
    """ours(**inputs) on our kernels, every input in the dtype it comes in (bf16 or fp32; integer ones as
    they are), against torch_fn on the same values twice: in float64 (the reference; ref_fn instead where
    given) and in those dtypes with its result cast to out_dtype (PyTorch's own, the twin), through
    check_bf16. For ops with a tuple of outputs, out_dtype is a tuple too. With grad_tol, one dy per
    output, in its dtype, goes back through all three, and every float input's gradient must come back in
    that input's dtype and pass the same checks."""
    grad = grad_tol is not None

    def leaves(cast):
        return {n: cast(t).detach().requires_grad_(grad) if t.is_floating_point() else t for n, t in inputs.items()}
    ours_in, twin_in, ref_in = leaves(lambda t: t), leaves(lambda t: t), leaves(lambda t: t.double())
    outs, twins, refs = outputs(ours(**ours_in)), outputs(torch_fn(**twin_in)), outputs((ref_fn or torch_fn)(**ref_in))
    dtypes = (out_dtype,) if isinstance(out_dtype, torch.dtype) else out_dtype
    twins = [(label, t.to(dt)) for (label, t), dt in zip(twins, dtypes, strict=True)]
    for (label, out), (_, twin), (_, ref), dt in zip(outs, twins, refs, dtypes, strict=True):
        assert out.dtype == dt, f"{label} dtype {out.dtype}, expected {dt}"
        check_bf16(label, out, twin, ref, bf16_tolerance(dt, tol))
    if not grad:
        return
    dys = [torch.randn(out.shape, device=out.device, dtype=out.dtype) for _, out in outs]  # by shape, as in compare()
    for results in (outs, twins):
        torch.autograd.backward([t for _, t in results], dys)
    torch.autograd.backward([t for _, t in refs], [d.double() for d in dys])
    for n, t in ours_in.items():
        if t.is_floating_point():
            assert t.grad is not None and t.grad.dtype == t.dtype, f"d{n}: {None if t.grad is None else t.grad.dtype}, not {t.dtype}"
            g = grad_tol[n] if isinstance(grad_tol, dict) else grad_tol
            check_bf16("d" + n, t.grad, twin_in[n].grad, ref_in[n].grad, bf16_tolerance(t.dtype, g))


# bf16 (Hopper): one bf16 rounding of each output (rtol 2^-8), plus fp32 accumulation error over the
# K products (atol 1e-4 * sqrt(K), far below an indexing slip's O(sqrt(K)))
def bf16_tol(K):
    return (1e-4 * math.sqrt(max(K, 1)), 2**-8)


def check_bf16(label, ours, twin, ref, tol, twin_nonfinite_ok=False):
    """ours against the float64 reference within tol, and no less accurate than PyTorch's bf16 twin:
    ours' max error at most twice the twin's plus tol's atol. (cuBLAS may add split-K partials in
    bf16, so the twin can be the less accurate of the two.) twin_nonfinite_ok: where the twin is known
    to break (SDPA's bf16 backends on a zero or negative scale), a twin that is not finite is reported
    and leaves the float64 check alone."""
    check(label, ours, ref, tol)
    if twin_nonfinite_ok and not twin.isfinite().all():
        CHECKS.append(f"{label}(torch) not finite")
        return
    err = (ours.double() - ref.double()).abs().max().item() if ours.numel() else 0.0
    twin_err = (twin.double() - ref.double()).abs().max().item() if twin.numel() else 0.0
    assert err <= 2 * twin_err + tol[0], f"{label}: max|err| {err:.2e}, torch's bf16 {twin_err:.2e}"
    CHECKS.append(f"{label}(torch) {twin_err:.1e}")


def compare_bf16(f, K, grad=True, tol=None, hopper=True, dy=None, twin_nonfinite_ok=False, **inputs):
    """f(kernels, **inputs) on bf16 inputs against two references: f(REF) in float64 on the same
    bf16-rounded values, and PyTorch's own bf16 op (its twin), through check_bf16. With grad, one
    bf16 dy (random unless given) goes back through all three and every float input's gradient is
    held to the same. tol: bf16_tol(K) unless given, as (atol, rtol) or a dict by 'out' and input
    name. hopper=False: the op runs from compute capability 8.0 (mma.sync), not only on wgmma. Float
    inputs already in bf16 reach our op as they are (same memory, strides and offset)."""
    if hopper and torch.cuda.get_device_capability() != (9, 0):
        raise Skip("bf16 matmul runs on Hopper's wgmma (compute capability 9.0)")
    if torch.cuda.get_device_capability() < (8, 0):
        raise Skip("bf16 tensor-core products need compute capability 8.0")
    tol = tol or bf16_tol(K)
    tol_of = (lambda n: tol[n]) if isinstance(tol, dict) else (lambda n: tol)

    def leaves(dtype):
        return {n: t.detach().to(torch.bfloat16).to(dtype).requires_grad_(grad) if t.is_floating_point() else t
                for n, t in inputs.items()}
    ours_in, twin_in, ref_in = leaves(torch.bfloat16), leaves(torch.bfloat16), leaves(torch.float64)
    out, twin, ref = f(kernels, **ours_in), f(REF, **twin_in), f(REF, **ref_in)
    assert out.dtype == torch.bfloat16, f"output dtype {out.dtype}, expected bfloat16"
    check_bf16("out", out, twin, ref, tol_of("out"), twin_nonfinite_ok)
    if not grad:
        return
    dy = torch.randn(out.shape, device=out.device, dtype=out.dtype) if dy is None else dy  # as in compare()
    for y in (out, twin):
        y.backward(dy)
    ref.backward(dy.double())
    for n, t in inputs.items():
        if t.is_floating_point():
            assert ours_in[n].grad is not None and ours_in[n].grad.dtype == torch.bfloat16, f"d{n}: no bf16 gradient"
            check_bf16("d" + n, ours_in[n].grad, twin_in[n].grad, ref_in[n].grad, tol_of(n), twin_nonfinite_ok)


# NaN and inf pass through as PyTorch passes them on (as its fp64 twin does): a row holding a NaN or +inf, or
# all -inf, normalizes to NaN, except that RMSNorm's rstd becomes 0 at an inf, which leaves the row 0 with NaN
# where the inf was; softmax gives 0 where -inf meets finite values and NaN where +inf or NaN is; cross-entropy
# a NaN loss and NaN row gradients for such rows, +inf for a target at -inf. The checks hold every NaN and
# inf to the twin's positions and the rest to the usual tolerances.
def nonfinite_rows(R, C):
    """R x C unit normals (R >= 6, C >= 3) but for a NaN in row 0, +inf in row 1, -inf in row 2, +inf and -inf
    in row 3, and row 4 all -inf."""
    nan, inf = float("nan"), float("inf")
    x = rand(R, C)
    x[0, C // 2], x[1, 0], x[2, C - 1], x[3, 1], x[3, 2] = nan, inf, -inf, inf, -inf
    x[4] = -inf
    return x


def launched_kernels(fn):
    """Names of the CUDA kernels fn() launches, as the profiler reports them."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


# ==== bad inputs ====
# Each op's block registers its bad inputs with bad_inputs(...): the case bad/<name> for each.


def raised_message(exc_type, call, what=""):
    """The message of the exc_type that call() must raise (AssertionError when it raises none)."""
    try:
        call()
    except exc_type as e:
        return str(e)
    raise AssertionError(f"no {exc_type.__name__} raised{what}")


def expect_error(exc_type, call, *names):
    """call() raises exc_type whose message names each of names (a tuple: any of them), and the GPU
    stays usable afterwards."""
    msg = raised_message(exc_type, call)
    for alternatives in names:
        alternatives = alternatives if isinstance(alternatives, tuple) else (alternatives,)
        assert any(re.search(rf"\b{re.escape(a)}\b", msg) for a in alternatives), \
            f"message does not name {' or '.join(alternatives)}: {one_line(msg)}"
    torch.cuda.synchronize()
    assert (torch.ones(4, device=DEV) * 2).sum().item() == 8, "GPU unusable after the error"
    return f"{exc_type.__name__}: {one_line(msg)[:120]}"


def _pos(*positions):  # int64 cache positions on the GPU
    return torch.tensor(positions, device=DEV)


BAD_CASES = []  # (name, exception, call, words its message must hold), each the case bad/<name>


def bad_inputs(*cases):
    """Registers each (name, exception, call, words its message must hold) as the case bad/<name>: call() raises
    the exception, whose message names each of the words (a tuple of them: any one), and the GPU stays usable
    (expect_error)."""
    for name, exc_type, call, words in cases:
        BAD_CASES.append((name, exc_type, call, words))
        add("bad/" + name, expect_error, exc_type, call, *words)


# Out-of-range indices (embedding's idx, cross_entropy's targets, expert_gemv's experts, kv_write's
# positions) are found by the kernels on the device, so the call itself does not raise (it would have to
# wait for the GPU): the bad rows come out NaN (a bad kv_write position writes nothing), and the next
# call of any op, or kernels.check_errors(), raises a ValueError that names the op, the argument, the
# value and the valid range. Raised once, it is gone.

def expect_index_error(call, op, arg, value, limit):
    msg = raised_message(ValueError, call, f" for {op}'s {arg} = {value}")
    want = f"{op}: {arg} out of range in an earlier call: got {value}, values must be in [0, {limit})"
    assert want in msg, f"the message {one_line(msg)!r} lacks {want!r}"
    kernels.check_errors()  # raised once: nothing is left pending
    assert kernels.softmax(rand(2, 3)).isfinite().all(), "the op after the error failed"
    return msg


# ==== dispatcher ops: opcheck arguments ====
# dispatcher ops: the ops registered as kernels::<name> pass torch.library.opcheck (schema, autograd
# registration, the meta version against the CUDA one in shapes, strides and dtypes, and AOT autograd's
# tracing of forward and backward), and a function of them compiles with fullgraph=True, no graph break.
# test_aot_dispatch_dynamic is not run: the meta versions are C++ functions of static shapes.
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static")


def _leaf(*shape, dtype=torch.float32, grad=True):
    return torch.randn(*shape, device=DEV, dtype=dtype).requires_grad_(grad)


def _plain(dt):
    """f(*shape): a _leaf in dtype dt that does not require grad (the backward ops' inputs)."""
    return lambda *shape, dtype=dt: _leaf(*shape, dtype=dtype, grad=False)


OPCHECK_ARGS = []  # f(dt) -> [(name, op, args, kwargs), ...], registered by the ops' blocks with @opcheck_args


def opcheck_args(fn):
    """Registers fn(dt) -> [(name, op, args, kwargs), ...]: an op block's calls of its dispatcher ops
    (torch.ops.kernels.<name>) at awkward shapes in dtype dt, as opcheck_cases lists them."""
    OPCHECK_ARGS.append(fn)
    return fn


def opcheck_cases(dt):
    """(name, op, args, kwargs) for every dispatcher op at awkward shapes in dtype dt, from every block's
    @opcheck_args; the forward ops' float inputs require grad (autograd is checked), the backward ops' do not."""
    return [case for fn in OPCHECK_ARGS for case in fn(dt)]


# ==== stress ====
# stress: the ops whose backward is several kernels handing partial results on through memory (the
# embedding's sort and run sums, cross-entropy's loss and gradient, the norms' partial column sums,
# attention's dK and dV summed over a group's heads, split-K products and their reduction). Each runs
# once, eagerly, for the reference bits; then STRESS_REPS times on a side stream, where the allocator
# hands out reused memory, and STRESS_REPS replays of one CUDA graph of it. A missing dependency between
# two of those kernels, a workspace read before it is written or a race inside one shows as a repetition
# that differs from the first in any bit.

STRESS_REPS = under_tool(200, 5)  # the tools slow each repetition many times over


def same_bits(first, got, where):
    for i, (a, b) in enumerate(zip(first, got, strict=True)):
        if not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().nan_to_num(float("inf")).max().item()
            raise AssertionError(f"{where}: result {i} differs from the first run by up to {diff:.2e}")


def stress(fn):
    """fn() -> tensors (outputs and gradients): bitwise the same on every repetition and replay."""
    first = [t.clone() for t in fn()]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for r in range(STRESS_REPS):
            same_bits(first, fn(), f"side-stream repetition {r}")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # the side stream's runs were its warm-up
        captured = fn()
    for r in range(STRESS_REPS):
        graph.replay()
        same_bits(first, captured, f"graph replay {r}")
    return f"{STRESS_REPS} side-stream runs and {STRESS_REPS} graph replays bitwise equal to the first"


def grads(out, leaves):
    """out and d(out . dy)/d(leaves) for a fixed dy, as a tuple (no .grad accumulates). out is returned
    detached: a result that kept this run's autograd graph alive would keep its leaves' gradient
    accumulators on the stream of this run, and a CUDA graph captured later would have to wait on it."""
    dy = torch.linspace(-1, 1, out.numel(), device=DEV).view_as(out).to(out.dtype) if out.dim() else torch.ones_like(out)
    return (out.detach(), *torch.autograd.grad(out, leaves, dy))


# ==== benchmark ====
# ours against PyTorch, same inputs, same run; each op's block adds its rows (@bench_rows)


ONLY = ""    # --only: bench ops whose name contains it
_FLUSH = []  # a 256 MB buffer, several times any L2, written before every timed rep


SPIN_CYCLES = 1_000_000  # ~0.5 ms of GPU clock: longer than any row's host-side launch work


def time_ms(fn, reps=50):
    """Median ms of fn over reps with a cold L2; the flush sits outside the timed region. Before each
    rep the GPU spins (torch.cuda._sleep) while the host queues the rep's launches, so a row times the
    GPU's work, not Python's and autograd's launch overhead (which the training and inference
    benchmarks measure end to end)."""
    if not _FLUSH:
        _FLUSH.append(torch.empty(64 * 2**20, device=DEV))
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once_ms = (time.perf_counter() - t0) * 1e3
    reps = max(10, min(reps, int(3000 / max(once_ms, 1e-3))))  # keep a slow op to ~3 s
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        _FLUSH[0].zero_()
        torch.cuda._sleep(SPIN_CYCLES)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def rel_check(ours, ref, tol):
    """max |ours - ref| / max |ref| over the output, or over each gradient."""
    pairs = zip(ours, ref) if isinstance(ours, (tuple, list)) else [(ours, ref)]
    errs = [((o - r).abs().max() / r.abs().max().clamp_min(1e-30)).item() for o, r in pairs]
    err = math.nan if any(math.isnan(e) for e in errs) else max(errs)
    ok = err <= tol
    return ok, f"{'ok' if ok else 'FAIL'} {err:.0e}"


def md_row(cells):
    return "| " + " | ".join(cells) + " |"


def fmt(x, spec):
    return "OOM" if x is None else format(x, spec)


UNIT_SCALE = {"TFLOP/s": 1e12, "GB/s": 1e9, "M matrices/s": 1e6, "M tokens/s": 1e6}


def print_header_once(rows):
    if not rows:  # the first row of the table
        print(md_row(["op", "shape", "pass", "torch ms", "ours ms", "torch/ours", "ours throughput", "check"]))
        print(md_row(["---"] * 8))


def grads_like(y):
    """Random output gradients for y, a tensor or a tuple of them (one each)."""
    return torch.randn_like(y) if torch.is_tensor(y) else tuple(torch.randn_like(t) for t in y)


def bench_op(rows, op, shape, pas, f, inputs, work, unit, tol=1e-4, check_fn=rel_check, copy_rate=None):
    """One table row: f(REF, *inputs) against f(kernels, *inputs). 'fwd' times f itself; 'bwd' times
    torch.autograd.grad on a graph built once and retained, so the forward is not in it; 'fwd+bwd'
    times a fresh forward and its torch.autograd.grad together (for ops whose cost is launches).
    Given copy_rate (bench_copy's), ours is also shown as a fraction of it (of_copy)."""
    if ONLY not in op:
        return
    print_header_once(rows)
    if pas == "fwd":
        def run_torch():
            return f(REF, *inputs)

        def run_ours():
            return f(kernels, *inputs)
    elif pas == "bwd":
        leaves = [t.detach().requires_grad_() if t.is_floating_point() else t for t in inputs]
        wrt = [t for t in leaves if t.requires_grad]
        y_torch, y_ours = f(REF, *leaves), f(kernels, *leaves)
        dy = grads_like(y_torch)

        def run_torch():
            return torch.autograd.grad(y_torch, wrt, dy, retain_graph=True)

        def run_ours():
            return torch.autograd.grad(y_ours, wrt, dy, retain_graph=True)
    else:
        assert pas == "fwd+bwd", f"unknown pass {pas!r}"
        leaves = [t.detach().requires_grad_() if t.is_floating_point() else t for t in inputs]
        wrt = [t for t in leaves if t.requires_grad]
        dy = grads_like(f(REF, *leaves))

        def run_torch():
            return torch.autograd.grad(f(REF, *leaves), wrt, dy)

        def run_ours():
            return torch.autograd.grad(f(kernels, *leaves), wrt, dy)
    ok, check_text = check_fn(run_ours(), run_torch(), tol)
    torch_ms, ours_ms = time_ms(run_torch), time_ms(run_ours)
    rate = work / (ours_ms * 1e-3) / UNIT_SCALE[unit]
    of_copy = {} if copy_rate is None else {"of_copy": rate / copy_rate}
    rows.append(dict(op=op, shape=shape, **{"pass": pas}, torch_ms=torch_ms, ours_ms=ours_ms,
                     ratio=torch_ms / ours_ms, rate=rate, unit=unit, **of_copy, check_ok=ok, check=check_text))
    print(md_row([op, shape, pas, f"{torch_ms:.4f}", f"{ours_ms:.4f}", f"{torch_ms / ours_ms:.2f}x",
                  f"{rate:.1f} {unit}" + (f" ({of_copy['of_copy']:.0%} of copy)" if of_copy else ""), check_text]),
          flush=True)


def bench_copy(rows, x):
    """A row for dst.copy_(x), device to device: the rate a kernel that reads x once and writes as much
    can hope for (bytes read + written), timed like every row. Returns its GB/s."""
    dst = torch.empty_like(x)
    ms = time_ms(lambda: dst.copy_(x))
    rate = 2 * x.numel() * x.element_size() / (ms * 1e-3) / UNIT_SCALE["GB/s"]
    shape = "x".join(map(str, x.shape))
    print_header_once(rows)
    rows.append(dict(op="copy", shape=shape, **{"pass": "fwd"}, torch_ms=ms, rate=rate, unit="GB/s"))
    print(md_row(["copy", shape, "fwd", f"{ms:.4f}", "-", "-", f"{rate:.1f} GB/s", "-"]), flush=True)
    return rate


_COPY_RATES = {}  # x's shape -> the rate bench_copy measured there, once a run


def copy_rate_for(rows, x, ops):
    """The rate of a copy of x (bench_copy's row, measured the first time a row asks for it), that ops' fwd rows
    are also given as a fraction of; None where --only selects neither copy nor any of ops."""
    if not any(ONLY in op for op in ("copy", *ops)):
        return None
    if tuple(x.shape) not in _COPY_RATES:
        _COPY_RATES[tuple(x.shape)] = bench_copy(rows, x)
    return _COPY_RATES[tuple(x.shape)]


def bench_row_ops(rows, row_ops, moved=None):
    """fp32 rows of ops on the rows of x, at 8192 x 768 and 16384 x 4096: row_ops are (op, f, inputs), inputs(x)
    giving f's inputs. A row is rated by the x-sized tensors it moves, moved[op] = (fwd, bwd), by default (2, 3):
    fwd reads x and writes y; bwd reads x (or y) and dy and writes dx. At 256 MB a fwd row moves the bytes of a
    copy of x: it is also given as a fraction of the copy's rate (the memory limit these kernels are held to)."""
    for R, C in ((8192, 768), (16384, 4096)):
        x = rand(R, C)
        nbytes = 4 * R * C
        copy_rate = copy_rate_for(rows, x, [op for op, _, _ in row_ops]) if (R, C) == (16384, 4096) else None
        for op, f, inputs in row_ops:
            n_fwd, n_bwd = (moved or {}).get(op, (2, 3))
            ins = inputs(x)
            bench_op(rows, op, f"{R}x{C}", "fwd", f, ins, n_fwd * nbytes, "GB/s", copy_rate=copy_rate)
            bench_op(rows, op, f"{R}x{C}", "bwd", f, ins, n_bwd * nbytes, "GB/s")


def bench_bf16_rows(rows, op, f, ins):
    """fwd and bwd rows of a bf16 op on the rows of ins[0] (R x C) against PyTorch's bf16 op: fwd reads x and
    writes y, bwd reads x and dy and writes dx, 2 bytes an element."""
    R, C = ins[0].shape
    bench_op(rows, op, f"{R}x{C}", "fwd", f, ins, 2 * 2 * R * C, "GB/s", tol=1e-2)
    bench_op(rows, op, f"{R}x{C}", "bwd", f, ins, 3 * 2 * R * C, "GB/s", tol=1e-2)


# --bench's tables, in the order it prints them; each op's block adds its functions with @bench_rows(table).
BENCH_TABLES = {table: [] for table in ("ops", "overhead", "attention", "attention_bf16", "attention gqa",
                                        "attention dropout", "megakernel", "mhc_profile", "hf", "hf_compiled", "ddp")}


def bench_rows(table):
    """Registers the decorated bench_<op>(rows), which appends its rows to rows, in table (one of BENCH_TABLES):
    --bench runs a table's functions in the order they are registered."""
    def register(fn):
        BENCH_TABLES[table].append(fn)
        return fn
    return register


def bench_table_selected(table):
    """--only picks the rows of the op table one by one (bench_op: the op's name contains it) and the other
    tables whole, where it is part of the table's name; ddp (training runs of --preset=large on one and two
    GPUs, minutes each) and hf_compiled (a compilation a row) only when asked for by name."""
    if table == "ops":
        return True
    return ONLY == table if table in ("ddp", "hf_compiled") else ONLY in table


def bench_main(json_path):
    if not HAS_CUDA:  # building the extension cannot help here
        print(f"--bench needs an NVIDIA GPU: PyTorch sees no CUDA device (torch {torch.__version__}); "
              f"it times our kernels against PyTorch's on the GPU")
        return 1
    if kernels is None:
        print(f"--bench needs the built extension: `import kernels` failed ({one_line(KERNELS_ERROR)}); {BUILD_HINT}")
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 against fp32: no TF32 shortcut for cuBLAS
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"median of up to 50 reps, L2 flushed before each\n")
    rows = []
    _COPY_RATES.clear()
    for table, fns in BENCH_TABLES.items():
        if bench_table_selected(table):
            for fn in fns:
                fn(rows)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"\nwrote {len(rows)} rows to {json_path}")
    failed = [r for r in rows if r.get("check_ok") is False]
    if failed:
        print(f"{len(failed)} rows where ours does not match torch")
    return 1 if failed else 0


# ==== op: gelu, silu ====
# gelu (exact and tanh) and silu against their float64 twins, forward and backward, in fp32 and in bf16
# (misaligned inputs too); their bad inputs, opcheck arguments and bench rows.


GELU_TOL, GELU_GRAD_TOL = (1e-6, 1e-5), (2e-6, 2e-5)


def t_gelu(shape, approximate, scale=1.0):
    compare(lambda ops, x: ops.gelu(x, approximate=approximate), GELU_TOL, GELU_GRAD_TOL,
            x=rand(*shape, scale=scale))


for _mode in ("none", "tanh"):
    for _shape, _scale in (((1,), 1), ((17, 33), 1), ((8192, 768), 1), ((1001,), 10)):
        add(f"gelu/{_mode}/" + "x".join(map(str, _shape)) + f"_x{_scale}" * (_scale != 1),
            t_gelu, _shape, _mode, _scale)


def t_silu(shape, scale=1.0):
    compare(lambda ops, x: ops.silu(x), GELU_TOL, GELU_GRAD_TOL, x=rand(*shape, scale=scale))


for _shape, _scale in (((1,), 1), ((17, 33), 1), ((8192, 768), 1), ((1001,), 10)):
    _suffix = "x".join(map(str, _shape)) + f"_x{_scale}" * (_scale != 1)
    add("silu/" + _suffix, t_silu, _shape, _scale)


def bf16_input(shape, scale=1.0, layout="contiguous"):
    if layout == "misaligned":  # 2 bytes into an allocation: no 16-byte loads
        return rand(1 + math.prod(shape), scale=scale).to(BF16)[1:].view(shape)
    return rand(*shape, scale=scale).to(BF16)


ACTIVATION_BF16_CASES = (((1,), 1, "contiguous"), ((17, 33), 1, "contiguous"), ((8192, 768), 1, "contiguous"),
                         ((1001,), 10, "contiguous"), ((37, 1000), 1, "misaligned"))


def activation_bf16_name(op, shape, scale, layout):
    return (f"{op}_bf16/" + "x".join(map(str, shape)) + f"_x{scale}" * (scale != 1)
            + f"_{layout}" * (layout != "contiguous"))


def t_activation_bf16(op, shape, scale=1.0, layout="contiguous"):
    def x_():
        return bf16_input(shape, scale, layout)
    approximate = "tanh" if op == "gelu_tanh" else "none"
    fns = {"gelu": (lambda ops, x: ops.gelu(x, approximate=approximate)), "silu": (lambda ops, x: ops.silu(x))}
    compare_dtypes(*on_both(fns[op.split("_")[0]]), GELU_TOL, GELU_GRAD_TOL, x=x_())


for _op in ("gelu", "gelu_tanh", "silu"):
    for _case in ACTIVATION_BF16_CASES:
        add(activation_bf16_name(_op, *_case), t_activation_bf16, _op, *_case)


bad_inputs(
    ("silu_cpu_x", RuntimeError, lambda: kernels.silu(torch.randn(4, 8)), ("silu", "x")),
    # string arguments: only the values the op knows
    ("gelu_approximate_exact", ValueError, lambda: kernels.gelu(rand(4, 8), approximate="exact"),
     ("gelu", "approximate", "exact")),
    ("gelu_approximate_Tanh_x_requires_grad", ValueError,
     lambda: kernels.gelu(rand(4, 8).requires_grad_(), approximate="Tanh"), ("gelu", "approximate", "Tanh")),
)


@opcheck_args
def opcheck_activations(dt):
    x, plain, k = _leaf(5, 7, 37, dtype=dt), _plain(dt), torch.ops.kernels
    return [("gelu", k.gelu, (x,), {}), ("gelu_tanh", k.gelu, (x,), {"approximate": "tanh"}),
            ("gelu_backward", k.gelu_backward, (plain(3, 41), plain(3, 41), "tanh"), {}),
            ("silu", k.silu, (x,), {}), ("silu_backward", k.silu_backward, (plain(3, 41), plain(3, 41)), {})]


@bench_rows("ops")
def bench_activations(rows):
    # bf16 against PyTorch's bf16 op: the large preset's tokens per step, an MLP of a 768-wide model
    R, C = 16384, 768
    bench_bf16_rows(rows, "gelu bf16", lambda ops, x: ops.gelu(x), [rand(R, 4 * C).to(BF16)])
    bench_row_ops(rows, (("gelu", lambda ops, x: ops.gelu(x), lambda x: [x]),
                         ("gelu tanh", lambda ops, x: ops.gelu(x, approximate="tanh"), lambda x: [x])))
    # SiLU at a feed-forward's width (tokens x hidden), as SwiGLU's rows below
    R, C = 8192, 2048
    a = rand(R, C)
    bench_op(rows, "silu", f"{R}x{C}", "fwd", lambda ops, a: ops.silu(a), [a], 4 * 2 * R * C, "GB/s")
    bench_op(rows, "silu", f"{R}x{C}", "bwd", lambda ops, a: ops.silu(a), [a], 4 * 3 * R * C, "GB/s")


# ==== op: swiglu ====
# swiglu against its float64 twin, forward and backward, in fp32 and in bf16 (the halves of one projection,
# misaligned inputs); its bad inputs, opcheck arguments and bench rows.


def t_swiglu(shape, scale=1.0, layout="contiguous"):
    # halves: a and b are the two halves of one projection's output (strided views, copied first);
    # misaligned: 4 bytes into an allocation, so the kernel's 16-byte loads must not be used
    if layout == "halves":
        a, b = rand(*shape[:-1], 2 * shape[-1], scale=scale).chunk(2, dim=-1)
    elif layout == "misaligned":
        n = math.prod(shape)
        a, b = (rand(1 + n, scale=scale)[1:].view(shape) for _ in range(2))
        assert a.data_ptr() % 16 and b.data_ptr() % 16
    else:
        a, b = rand(*shape, scale=scale), rand(*shape, scale=scale)
    compare(lambda ops, a, b: ops.swiglu(a, b), GELU_TOL, GELU_GRAD_TOL, a=a, b=b)


for _shape, _scale in (((1,), 1), ((17, 33), 1), ((8192, 768), 1), ((1001,), 10)):
    add("swiglu/" + "x".join(map(str, _shape)) + f"_x{_scale}" * (_scale != 1), t_swiglu, _shape, _scale)
add("swiglu/37x1000_halves", t_swiglu, (37, 1000), layout="halves")
add("swiglu/37x1000_misaligned", t_swiglu, (37, 1000), layout="misaligned")
add("empty/swiglu_0x64", t_swiglu, (0, 64))


def t_swiglu_bf16(shape, scale=1.0, layout="contiguous"):
    compare_dtypes(kernels.swiglu, REF.swiglu, GELU_TOL, GELU_GRAD_TOL, a=bf16_input(shape, scale, layout),
                   b=bf16_input(shape, scale, layout))


for _case in ACTIVATION_BF16_CASES:
    add(activation_bf16_name("swiglu", *_case), t_swiglu_bf16, *_case)

bad_inputs(
    ("swiglu_shape_mismatch", RuntimeError, lambda: kernels.swiglu(rand(4, 8), rand(4, 9)), ("swiglu", "a", "b")),
    ("swiglu_float64_b", RuntimeError, lambda: kernels.swiglu(rand(4, 8), rand(4, 8).double()), ("swiglu", "b")),
    # bf16: one dtype for both inputs
    ("swiglu_bf16_a_float32_b", RuntimeError, lambda: kernels.swiglu(rand(4, 8).bfloat16(), rand(4, 8)),
     ("swiglu", "b", "BFloat16")),
)


@opcheck_args
def opcheck_swiglu(dt):
    plain = _plain(dt)
    return [("swiglu", torch.ops.kernels.swiglu, (_leaf(5, 7, 37, dtype=dt), _leaf(5, 7, 37, dtype=dt)), {}),
            ("swiglu_backward", torch.ops.kernels.swiglu_backward, (plain(3, 41), plain(3, 41), plain(3, 41)), {})]


@bench_rows("ops")
def bench_swiglu(rows):
    # SwiGLU's gate at a feed-forward's width (tokens x hidden): fwd reads a, b and writes y; bwd reads
    # a, b, dy and writes da, db
    R, C = 8192, 2048
    a, b = rand(R, C), rand(R, C)
    bench_op(rows, "swiglu", f"{R}x{C}", "fwd", lambda ops, a, b: ops.swiglu(a, b), [a, b], 4 * 3 * R * C, "GB/s")
    bench_op(rows, "swiglu", f"{R}x{C}", "bwd", lambda ops, a, b: ops.swiglu(a, b), [a, b], 4 * 5 * R * C, "GB/s")


# ==== op: rope ====
# rope against its float64 twin (and bit for bit against the fp32 one), forward and backward, contiguous,
# (B, T, H, D) and fused-QKV views, in fp32 and bf16; its bad inputs, opcheck arguments and bench rows.


# |out| is a sum of two products of |x| <= ~5 and |cos|, |sin| <= 1: an ulp of ~8 is 1e-6
ROPE_TOL = (2e-6, 1e-5)


def rope_tables(T, D, offset=0):
    """cos, sin (T, D/2) of positions offset .. offset + T - 1, as train.GPT builds them."""
    freq = train.ROPE_THETA ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = torch.arange(offset, offset + T, dtype=torch.float64)[:, None] * freq
    return angles.cos().float().to(DEV), angles.sin().float().to(DEV)


def t_rope(B, H, T, D, offset=0, layout="contiguous"):
    # bshd: (B, T, H, D) memory seen through a transpose; qkv: the key slice of a fused (B, T, 3HD)
    # projection, as the model passes it (read in place, strided)
    if layout == "bshd":
        x = rand(B, T, H, D).transpose(1, 2)
    elif layout == "qkv":
        x = rand(B, T, 3 * H * D)[..., H * D:2 * H * D].view(B, T, H, D).transpose(1, 2)
    else:
        x = rand(B, H, T, D)
    cos, sin = rope_tables(T, D, offset)
    # the tables are constants, not inputs: they get no gradient
    compare(lambda ops, x: ops.rope(x, cos.to(x.dtype), sin.to(x.dtype)), ROPE_TOL, ROPE_TOL, x=x)
    # the forward rounds each product as PyTorch's twin does: equal bit for bit in fp32
    ours, twin = kernels.rope(x, cos, sin), train.TORCH_OPS.rope(x, cos, sin)
    assert torch.equal(ours, twin), f"not bitwise equal to the fp32 twin: max diff {(ours - twin).abs().max():.1e}"


for _B, _H, _T, _D, _off, _layout in ((1, 1, 1, 2, 0, "contiguous"), (2, 3, 17, 64, 0, "contiguous"),
                                      (2, 3, 1, 64, 1000, "contiguous"), (1, 8, 1, 96, 255, "contiguous"),
                                      (3, 5, 33, 6, 7, "contiguous"), (2, 3, 17, 64, 0, "bshd"),
                                      (2, 4, 65, 32, 0, "qkv"), (4, 8, 256, 128, 0, "contiguous"),
                                      (1, 2, 4097, 64, 0, "qkv")):
    add(f"rope/b{_B}h{_H}t{_T}d{_D}" + f"_from{_off}" * (_off != 0) + f"_{_layout}" * (_layout != "contiguous"),
        t_rope, _B, _H, _T, _D, _off, _layout)
add("empty/rope_b2h3t0d64", t_rope, 2, 3, 0, 64)


def t_rope_bf16(B, H, T, D, layout):
    # qkv: k's heads in place in a bf16 (B, T, 3 H D) projection (cast first: a cast of the view would copy it)
    x = rand(B, T, 3 * H * D).to(BF16)[..., H * D:2 * H * D].view(B, T, H, D).transpose(1, 2) if layout == "qkv" \
        else rand(B, H, T, D).to(BF16)
    assert layout != "qkv" or not x.is_contiguous(), "the qkv case must hand the op a strided view"
    cos, sin = rope_tables(T, D)
    # the fp32 tables promote the twin's rotation to fp32 (and the reference's to float64)
    compare_dtypes(lambda x: kernels.rope(x, cos, sin), lambda x: train.torch_rope(x, cos, sin), ROPE_TOL, ROPE_TOL,
                   x=x)


add("rope_bf16/b2h3t17d64", t_rope_bf16, 2, 3, 17, 64, "contiguous")
add("rope_bf16/b2h4t65d32_qkv", t_rope_bf16, 2, 4, 65, 32, "qkv")


bad_inputs(
    ("rope_odd_D", ValueError, lambda: kernels.rope(rand(2, 3, 5, 7), rand(5, 3), rand(5, 3)), ("rope", "D")),
    ("rope_table_shape", RuntimeError, lambda: kernels.rope(rand(2, 3, 5, 8), rand(4, 4), rand(4, 4)),
     ("rope", "cos", "sin")),
    ("rope_table_grad", RuntimeError,
     lambda: kernels.rope(rand(2, 3, 5, 8), rand(5, 4).requires_grad_(), rand(5, 4)), ("rope", "cos")),
    ("rope_cpu_x", RuntimeError, lambda: kernels.rope(torch.randn(2, 3, 5, 8), rand(5, 4), rand(5, 4)), ("rope", "x")),
    ("rope_3d_x", RuntimeError, lambda: kernels.rope(rand(3, 5, 8), rand(5, 4), rand(5, 4)), ("rope", "x")),
)


@opcheck_args
def opcheck_rope(dt):
    plain, k = _plain(dt), torch.ops.kernels
    ang = torch.rand(5, 4, device=DEV) * 6.28
    cos, sin = ang.cos(), ang.sin()
    return [("rope", k.rope, (_leaf(2, 3, 5, 8, dtype=dt), cos, sin), {}),
            ("rope_backward", k.rope_backward, (plain(2, 3, 5, 8), cos, sin), {})]


@bench_rows("ops")
def bench_rope(rows):
    # RoPE on q as the model passes it: a strided head view of the fused QKV projection (the larger
    # preset's shape, B 64, T 256, 6 heads of 64); reads x, writes the contiguous result (bwd: dy, dx)
    B, T, H, D = 64, 256, 6, 64
    x = rand(B, T, 3 * H * D)[..., :H * D].view(B, T, H, D).transpose(1, 2)
    cos, sin = rope_tables(T, D)
    for pas in ("fwd", "bwd"):
        bench_op(rows, "rope", f"{B}x{H}x{T}x{D} qkv view", pas, lambda ops, x: ops.rope(x, cos, sin), [x],
                 4 * 2 * x.numel(), "GB/s")


# ==== op: dropout ====
# dropout against its twin bit for bit (train.torch_dropout: Philox4x32-10 in PyTorch), forward and backward,
# in fp32 and bf16, at awkward sizes; the masks' keep rate within binomial bounds at every column position,
# the scaling by 1 / (1 - p), p = 0 and 1, fresh masks under CUDA-graph replay; the twin's Philox against
# Random123's known answers (CPU); its bad inputs, opcheck arguments and bench rows.


def dropout_rng(seed=1234, offset=0):
    return torch.tensor([seed, offset], device=DEV)


def t_dropout(shape, p, dtype=torch.float32, salt=0, layout="contiguous"):
    # misaligned: 4 bytes into an allocation (the kernel's scalar path); the mask is a function of (row, column)
    # of the last dim, so a strided x (a transpose, copied first) must give the twin's mask of its own shape
    x = (misaligned(*shape) if layout == "misaligned" else rand(*shape).t() if layout == "transposed"
         else rand(*shape)).to(dtype)
    rng = dropout_rng(seed=-977 * (1 + salt), offset=2**31 + 5)  # a negative seed: its high word is used too
    leaf = lambda: x.detach().clone().requires_grad_()
    a, b = leaf(), leaf()
    ours, twin = kernels.dropout(a, p, rng, salt), train.torch_dropout(b, p, rng, salt)
    assert ours.dtype == dtype and ours.shape == x.shape, (ours.dtype, ours.shape)
    assert torch.equal(ours, twin), f"not bit-equal to the twin: {int((ours != twin).sum())} of {x.numel()} differ"
    dy = rand(*x.shape).to(dtype)
    ours.backward(dy)
    twin.backward(dy)
    assert torch.equal(a.grad, b.grad), f"dx not bit-equal: {int((a.grad != b.grad).sum())} of {x.numel()} differ"
    kept = ours != 0
    if dtype == torch.float32:  # every kept value is x * fp32(1 / (1 - p)) exactly, every other one 0
        scale = torch.tensor(1 / (1 - p) if p < 1 else 0.0, dtype=torch.float32)
        assert torch.equal(ours[kept], x[kept] * scale.to(DEV)), "a kept value is not x / (1 - p)"
    # against float64: a kept value's one rounding of x * scale, half an fp32 ulp (the fp32 op, on the bf16
    # case's rounded values too: the bf16 op is held to the twin bit for bit above)
    compare(lambda ops, x: ops.dropout(x, p, rng, salt), (0.0, 2**-24), (0.0, 2**-24), x=x.float())
    return f"bit-equal forward and backward; kept {kept.float().mean().item():.4f} (1 - p = {1 - p:.4f})"


for _shape, _p in (((1,), 0.5), ((17, 33), 0.2), ((3, 1001), 0.1), ((5, 7, 37), 0.9), ((8192, 768), 0.2),
                   ((64, 32), 0.999), ((31, 65), 0.0), ((2, 3), 1.0)):
    add("dropout/" + "x".join(map(str, _shape)) + f"_p{_p}", t_dropout, _shape, _p)
# rows of whole 32-column segments (dropout_segments_kernel): a last warp partly full (21 and 65 segments)
add("dropout/7x96_p0.3", t_dropout, (7, 96), 0.3)
add("dropout_bf16/13x160_p0.3", t_dropout, (13, 160), 0.3, dtype=BF16)
add("dropout/37x1000_p0.3_misaligned", t_dropout, (37, 1000), 0.3, layout="misaligned")
add("dropout/37x1024_p0.3_misaligned", t_dropout, (37, 1024), 0.3, layout="misaligned")
# past the grid's cap (32 blocks of 256 segments an SM): a warp's second group reuses its shared memory
add("dropout_bf16/1100x32768_p0.2", t_dropout, (1100, 32768), 0.2, dtype=BF16)
add("dropout/100x37_p0.3_transposed", t_dropout, (100, 37), 0.3, layout="transposed")
add("dropout/17x33_p0.2_salt7", t_dropout, (17, 33), 0.2, salt=7)
add("empty/dropout_0x64", t_dropout, (0, 64), 0.2)
for _shape, _p in (((17, 33), 0.2), ((3, 1001), 0.5), ((8192, 768), 0.1)):
    add("dropout_bf16/" + "x".join(map(str, _shape)) + f"_p{_p}", t_dropout, _shape, _p, dtype=BF16)


def t_dropout_keep_rate(p):
    # 2^22 draws: the kept count within 6 sigma of n (1 - p), p held to 1/65536 (the 16-bit draws); and
    # at each of the 32 column positions of a counter's unit, and for each of 8 salts: a lane that reused
    # another's bits, or a salt that changed nothing, shows up as a rate or an overlap off its binomial
    R, C = 4096, 1024
    ones = torch.ones(R, C, device=DEV)
    q = round(p * 65536) / 65536  # the drop probability the 16-bit threshold gives
    masks = [kernels.dropout(ones, p, dropout_rng(), salt) != 0 for salt in range(8)]
    n, kept = R * C, masks[0].sum().item()
    sigma = math.sqrt(n * q * (1 - q))
    assert abs(kept - n * (1 - q)) <= 6 * sigma, f"kept {kept} of {n}, expected {n * (1 - q):.0f} +- {6 * sigma:.0f}"
    by_col = masks[0].view(R, C // 32, 32).sum((0, 1)).double()  # kept at column position c % 32
    per, sigma_col = n / 32, math.sqrt(n / 32 * q * (1 - q))
    worst_col = (by_col - per * (1 - q)).abs().max().item()
    assert worst_col <= 6 * sigma_col, f"a column position's keep count is {worst_col:.0f} off ({6 * sigma_col:.0f})"
    both = max((a & b).sum().item() for i, a in enumerate(masks) for b in masks[i + 1:])
    expect, sigma_both = n * (1 - q) ** 2, math.sqrt(n * (1 - q) ** 2 * (1 - (1 - q) ** 2))
    assert abs(both - expect) <= 6 * sigma_both + 1, f"two salts keep {both} together, expected {expect:.0f}"
    return (f"kept {kept} of {n} ({abs(kept - n * (1 - q)) / sigma:.1f} sigma); worst column position "
            f"{worst_col / sigma_col:.1f} sigma; two salts' overlap {both}, expected {expect:.0f}")


for _p in (0.1, 0.5, 0.97):
    add(f"dropout/keep_rate_p{_p}", t_dropout_keep_rate, _p)


def t_dropout_graph_replay():
    # rng's offset advanced inside a CUDA graph: each replay draws the next step's masks, as the twin
    # computes them for that offset (a kernel reading {seed, offset} at capture would repeat one mask)
    x, rng = rand(64, 100), dropout_rng(offset=0)
    y = kernels.dropout(x, 0.5, rng, 3)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rng[1:].add_(1)
        y = kernels.dropout(x, 0.5, rng, 3)
    outs = []
    for step in range(1, 4):
        graph.replay()
        outs.append(y.clone())
        assert torch.equal(outs[-1], train.torch_dropout(x, 0.5, dropout_rng(offset=step), 3)), f"replay {step}"
    assert not torch.equal(outs[0], outs[1]), "two replays drew the same mask"
    return "3 replays, offsets 1..3, each the twin's mask"


add("dropout/graph_replay", t_dropout_graph_replay)


def dropout_philox_known_answers():
    # Random123's known-answer vectors for Philox4x32-10 (kat_vectors): counter, key -> output
    kat = [((0, 0, 0, 0), (0, 0), (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
           ((0xffffffff,) * 4, (0xffffffff,) * 2, (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)),
           ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
            (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1))]
    for ctr, key, want in kat:
        got = tuple(int(w) for w in train.philox(tuple(map(torch.tensor, ctr)), tuple(map(torch.tensor, key))))
        assert got == want, f"philox({ctr}, {key}) = {tuple(map(hex, got))}, expected {tuple(map(hex, want))}"
    return f"{len(kat)} known answers"


add("dropout/philox_known_answers", dropout_philox_known_answers, gpu=False)


def dropout_twin_compiles():
    # the twin under torch.compile(fullgraph=True), as --compile=true runs the torch op set: one graph, the
    # same mask bit for bit (Inductor keeps the int64 words exact)
    x, rng = torch.randn(37, 100), torch.tensor([1234, 5])
    eager = train.torch_dropout(x, 0.3, rng, 7)
    compiled = torch.compile(train.torch_dropout, fullgraph=True)(x, 0.3, rng, 7)
    assert torch.equal(eager, compiled), f"{int((eager != compiled).sum())} of {x.numel()} differ compiled"
    return "compiled whole, bit-equal to eager"


add("dropout/twin_compiles", dropout_twin_compiles, gpu=False)


@mutant("dropout_twin_branches_on_the_offset", "dropout/twin_compiles")
def _dropout_twin_branches_on_the_offset():
    # the twin branches on rng's value on the host (a sync that breaks the graph)
    real = train.dropout_keep

    def keep(rows, cols, p, rng, salt, device):
        return real(rows, cols, p, rng if bool(rng[1] >= 0) else -rng, salt, device)
    with unittest.mock.patch.object(train, "dropout_keep", keep):
        yield

bad_inputs(
    ("dropout_p_above_1", ValueError, lambda: kernels.dropout(rand(4, 8), 1.5, dropout_rng()), ("dropout", "p")),
    ("dropout_p_negative", ValueError, lambda: kernels.dropout(rand(4, 8), -0.1, dropout_rng()), ("dropout", "p")),
    ("dropout_rng_shape", RuntimeError, lambda: kernels.dropout(rand(4, 8), 0.5, torch.tensor([1], device=DEV)),
     ("dropout", "rng")),
    ("dropout_rng_float", RuntimeError, lambda: kernels.dropout(rand(4, 8), 0.5, rand(2)), ("dropout", "rng")),
    ("dropout_rng_cpu", RuntimeError, lambda: kernels.dropout(rand(4, 8), 0.5, torch.tensor([1, 2])),
     ("dropout", "rng")),
    ("dropout_salt_negative", ValueError, lambda: kernels.dropout(rand(4, 8), 0.5, dropout_rng(), -1),
     ("dropout", "salt")),
    ("dropout_float64_x", RuntimeError, lambda: kernels.dropout(rand(4, 8).double(), 0.5, dropout_rng()),
     ("dropout", "x")),
)


@opcheck_args
def opcheck_dropout(dt):
    return [("dropout", torch.ops.kernels.dropout, (_leaf(5, 7, 37, dtype=dt), 0.3, dropout_rng(), 2), {})]


def dropout_check(ours, theirs, tol):
    """Ours and PyTorch's F.dropout draw different masks: their dropped fractions agree within tol."""
    frac = lambda t: (t[0] if isinstance(t, tuple) else t).eq(0).float().mean().item()
    a, b = frac(ours), frac(theirs)
    return abs(a - b) <= tol, f"dropped {a:.4f} vs {b:.4f}"


@bench_rows("ops")
def bench_dropout(rows):
    # dropout at p = 0.1 against F.dropout (PyTorch's fused kernel, which also writes its mask) on the
    # 256 MB rows where the copy's rate is measured: fwd reads x and writes y; bwd reads dy, writes dx
    R, C = 16384, 4096
    x, rng = rand(R, C), dropout_rng()
    copy_rate = copy_rate_for(rows, x, ["dropout"])

    def f(ops, x):
        return kernels.dropout(x, 0.1, rng) if ops is kernels else F.dropout(x, 0.1, training=True)
    for pas in ("fwd", "bwd"):
        bench_op(rows, "dropout", f"{R}x{C}", pas, f, [x], 2 * 4 * R * C, "GB/s", tol=2e-3, check_fn=dropout_check,
                 copy_rate=copy_rate if pas == "fwd" else None)
    xb = x.bfloat16()
    for pas in ("fwd", "bwd"):
        bench_op(rows, "dropout bf16", f"{R}x{C}", pas, f, [xb], 2 * 2 * R * C, "GB/s", tol=2e-3,
                 check_fn=dropout_check)


# ==== op: softmax ====
# softmax against its float64 twin, forward and backward, at widths up to 50304 and logit scales to 100,
# NaN and inf passed on as the twin's, in fp32 and bf16; its bad inputs, opcheck arguments and bench rows.


# probabilities run from 1 down to 1e-7 and below, so the bound is mostly relative
SM_TOL, SM_GRAD_TOL = (1e-7, 1e-5), (1e-6, 1e-5)


def t_softmax(shape, scale=1.0, transposed=False):
    x = rand(*shape[::-1], scale=scale).t() if transposed else rand(*shape, scale=scale)
    compare(lambda ops, x: ops.softmax(x), SM_TOL, SM_GRAD_TOL, x=x)


for _shape, _scale in (((1, 1), 1), ((37, 17), 1), ((2, 5, 17), 1), ((37, 1000), 1), ((37, 1000), 100),
                       ((4, 50304), 1), ((4, 50304), 100)):
    add("softmax/" + "x".join(map(str, _shape)) + f"_x{_scale}" * (_scale != 1), t_softmax, _shape, _scale)
add("softmax/37x1000_transposed", t_softmax, (37, 1000), transposed=True)


def t_softmax_nonfinite(R, C):
    compare(lambda ops, x: ops.softmax(x), SM_TOL, SM_GRAD_TOL, nonfinite=True, x=nonfinite_rows(R, C))


for _R, _C in ((37, 17), (8, 50304)):
    add(f"softmax/nonfinite_{_R}x{_C}", t_softmax_nonfinite, _R, _C)


def t_softmax_bf16(shape, scale, out):
    x = rand(*shape, scale=scale).to(BF16)
    grad_tol = SM_GRAD_TOL
    if out == BF16:
        # the backward reads the saved bf16 y: dx_i = y_i (dy_i - sum_j dy_j y_j) carries y's rounding
        # (2^-9 relative) times |dy_i| + |sum| + max|dy| <= 3 * 5 (dy ~ randn), an error relative to y_i,
        # not to dx_i, which can cancel to far less
        grad_tol = (2**-9 * 3 * 5 * torch.softmax(x.double(), -1).max().item(), SM_GRAD_TOL[1])
    compare_dtypes(lambda x: kernels.softmax(x, out_dtype=out), REF.softmax, SM_TOL, grad_tol, out, x=x)


for _shape, _scale, _out in (((1, 1), 1, BF16), ((37, 1000), 1, BF16), ((4, 50304), 100, BF16),
                             ((4096, 8), 1, torch.float32), ((37, 1000), 1, torch.float32)):
    add("softmax_bf16/" + "x".join(map(str, _shape)) + f"_x{_scale}" * (_scale != 1) + "_to_fp32" * (_out != BF16),
        t_softmax_bf16, _shape, _scale, _out)


bad_inputs(
    ("softmax_float64_x", RuntimeError, lambda: kernels.softmax(rand(4, 8).double()), ("softmax", "x")),
    # out_dtype float32 or bfloat16
    ("softmax_out_float64", ValueError, lambda: kernels.softmax(rand(4, 8), out_dtype=torch.float64),
     ("softmax", "out_dtype")),
)


@opcheck_args
def opcheck_softmax(dt):
    x, plain, k = _leaf(5, 7, 37, dtype=dt), _plain(dt), torch.ops.kernels
    return [("softmax", k.softmax, (x,), {}), ("softmax_fp32_out", k.softmax, (x,), {"out_dtype": torch.float32}),
            ("softmax_backward", k.softmax_backward, (plain(5, 37), plain(5, 37), dt), {})]


@bench_rows("ops")
def bench_softmax(rows):
    # bf16 against PyTorch's bf16 op: the large preset's tokens per step and a 768-wide model
    R, C = 16384, 768
    bench_bf16_rows(rows, "softmax bf16", lambda ops, x: ops.softmax(x), [rand(R, C).to(BF16)])
    bench_row_ops(rows, (("softmax", lambda ops, x: ops.softmax(x), lambda x: [x]),))


# ==== op: layernorm, rmsnorm, add_layernorm, add_rmsnorm ====
# the norms and the residual add with the norm against their float64 twins, forward and backward (the
# weights' column-sum gradients too), fp32, bf16 and mixed; bad inputs, opcheck arguments, stress, bench.


# y = xhat * w + b with |xhat| up to ~4 and |w| up to ~3: a few fp32 ulps of ~10
LN_TOL, LN_GRAD_TOL = 2e-5, 1e-4


def t_layernorm(shape, transposed=False, eps=1e-5):
    C = shape[-1]
    x = rand(*shape[::-1]).t() if transposed else rand(*shape)
    # width 1: var = 0, so rstd = 1/sqrt(eps) ~ 316 multiplies the rounding of dy*w - mean(dy*w),
    # which is exactly 0 in float64
    grad_tol = LN_GRAD_TOL * (10 if C == 1 else 1)
    # dw and db add one term per row: their fp32 rounding grows like the square root of the rows
    sum_tol = grad_tol * max(1.0, (math.prod(shape[:-1]) / 1000) ** 0.5)
    compare(lambda ops, x, w, b: ops.layernorm(x, w, b, eps=eps), LN_TOL, dict(x=grad_tol, w=sum_tol, b=sum_tol),
            x=x, w=rand(C), b=rand(C))


# The weight gradients' column sums ride on the dx pass up to 2048 units a row (8192 columns 4-wide):
# a warp a row, 8 rows a block (4 where a thread caches 8 units), or a block a row. The blocks walk the
# rows a grid apart, as many blocks as the GPU holds, so these row counts (past an H100's 132 SMs' worth)
# make each block sum several rows: 40000 x 127 and 3000 x 1001 (one-wide loads), 5000 x 388, 3000 x
# 1000, 3000 x 1536, 600 x 8192. Wider rows sum in a pass of their own (4 x 65536).
for _shape in ((1, 1), (37, 1), (1, 127), (37, 127), (1, 768), (37, 768), (2, 7, 768), (1, 4097), (3, 4097),
               (5000, 388), (3000, 127), (40000, 127), (3000, 1000), (3000, 1001), (3000, 1536), (600, 8192),
               (4, 65536)):
    add("layernorm/" + "x".join(map(str, _shape)), t_layernorm, _shape)
add("layernorm/37x768_transposed", t_layernorm, (37, 768), transposed=True)
add("layernorm/37x768_eps1e-3", t_layernorm, (37, 768), eps=1e-3)


add("empty/layernorm_0x768", t_layernorm, (0, 768))


def t_rmsnorm(shape, transposed=False, eps=1e-5):
    # y = xhat * w as in layernorm (xhat = x * rstd), so the same tolerances, and the same x10 for
    # width 1, where dx = rstd * g * (1 - xhat^2) cancels
    C = shape[-1]
    x = rand(*shape[::-1]).t() if transposed else rand(*shape)
    grad_tol = LN_GRAD_TOL * (10 if C == 1 else 1)
    sum_tol = grad_tol * max(1.0, (math.prod(shape[:-1]) / 1000) ** 0.5)  # as in t_layernorm
    compare(lambda ops, x, w: ops.rmsnorm(x, w, eps=eps), LN_TOL, dict(x=grad_tol, w=sum_tol), x=x, w=rand(C))


for _shape in ((1, 1), (37, 1), (1, 127), (37, 127), (1, 768), (37, 768), (2, 7, 768), (1, 4097), (3, 4097),
               (5000, 388), (3000, 1000), (20000, 255), (600, 8192), (4, 65536)):
    add("rmsnorm/" + "x".join(map(str, _shape)), t_rmsnorm, _shape)
add("rmsnorm/37x768_transposed", t_rmsnorm, (37, 768), transposed=True)
add("rmsnorm/37x768_eps1e-3", t_rmsnorm, (37, 768), eps=1e-3)
add("empty/rmsnorm_0x768", t_rmsnorm, (0, 768))


def t_add_norm(kind, shape, use=("s", "y"), y_misaligned=False):
    """add_layernorm / add_rmsnorm in fp32: (s, norm(s)), s = x + y. use: the outputs the caller goes on
    with, so the backward meets both gradients, the norm's alone (s unused: the model's final norm) or
    s's alone (the norm unused; its weights then get no gradient and are left out of the check).
    y_misaligned: y starts one float into its allocation, so the kernels take their one-wide path."""
    C = shape[-1]
    w, b = rand(C), rand(C)
    y = misaligned(*shape) if y_misaligned else rand(*shape)
    grad_tol = LN_GRAD_TOL * (10 if C == 1 else 1)  # as in t_layernorm
    sum_tol = grad_tol * max(1.0, (math.prod(shape[:-1]) / 1000) ** 0.5)

    def pick(out):
        return out if len(use) == 2 else out[("s", "y").index(use[0])]
    if "y" not in use:  # weights in x's dtype, as the reference runs in float64
        compare(lambda ops, x, y: pick(getattr(ops, "add_" + kind)(
            x, y, w.to(x.dtype), *([b.to(x.dtype)] if kind == "layernorm" else []))), LN_TOL, grad_tol,
            x=rand(*shape), y=y)
    elif kind == "layernorm":
        compare(lambda ops, x, y, w, b: pick(ops.add_layernorm(x, y, w, b)), LN_TOL,
                dict(x=grad_tol, y=grad_tol, w=sum_tol, b=sum_tol), x=rand(*shape), y=y, w=w, b=b)
    else:
        compare(lambda ops, x, y, w: pick(ops.add_rmsnorm(x, y, w)), LN_TOL, dict(x=grad_tol, y=grad_tol, w=sum_tol),
                x=rand(*shape), y=y, w=w)


# widths as for the norms: 1 (zero variance), odd (one column a thread), 768 (4 a thread, a warp a row),
# 1536 and 4096 (256 threads a row), 9001 and 65536 (1024 threads, rows past the register cache: the tail
# loops form s on their first pass and re-read it); a misaligned y (the one-wide path at a 4-wide width)
for _kind in ("layernorm", "rmsnorm"):
    for _shape in ((1, 1), (37, 127), (2, 7, 768), (3, 1536), (5, 4096), (2, 9001), (2, 65536), (3000, 388)):
        add(f"add_{_kind}/" + "x".join(map(str, _shape)), t_add_norm, _kind, _shape)
    add(f"add_{_kind}/37x768_y_misaligned", t_add_norm, _kind, (37, 768), y_misaligned=True)
    add(f"add_{_kind}/37x768_norm_only", t_add_norm, _kind, (37, 768), use=("y",))
    add(f"add_{_kind}/37x768_sum_only", t_add_norm, _kind, (37, 768), use=("s",))


def t_norm_nonfinite(kind, R, C):
    sum_tol = LN_GRAD_TOL * max(1.0, (R / 1000) ** 0.5)  # as in t_layernorm
    if kind == "layernorm":
        compare(lambda ops, x, w, b: ops.layernorm(x, w, b), LN_TOL, dict(x=LN_GRAD_TOL, w=sum_tol, b=sum_tol),
                nonfinite=True, x=nonfinite_rows(R, C), w=rand(C), b=rand(C))
    else:  # against the formula: PyTorch's CUDA rms_norm turns a row holding inf into NaN throughout
        compare(lambda ops, x, w: ops.rmsnorm(x, w) if ops is kernels else rmsnorm_formula(x, w), LN_TOL,
                dict(x=LN_GRAD_TOL, w=sum_tol), nonfinite=True, x=nonfinite_rows(R, C), w=rand(C))


def rmsnorm_formula(x, w, eps=train.LN_EPS):
    """RMSNorm as its formula reads: a row holding inf gives its finite entries 0 (their rstd is 0) and the inf
    NaN, as ours and PyTorch's CPU rms_norm do."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


for _R, _C in ((37, 768), (8, 65536)):  # 65536: rows past the register cache, and the norms' separate column sums
    for _kind in ("layernorm", "rmsnorm"):
        add(f"{_kind}/nonfinite_{_R}x{_C}", t_norm_nonfinite, _kind, _R, _C)


NORM_MODES = {"bf16": (BF16, BF16), "fp32_to_bf16": (torch.float32, BF16), "bf16_to_fp32": (BF16, torch.float32)}


def t_norm_bf16(kind, shape, mode):
    # mode: x and weights' dtype -> y's (fp32_to_bf16: mixed-precision training's fp32 residual stream)
    dt, out = NORM_MODES[mode]
    C = shape[-1]
    x, w, b = rand(*shape).to(dt), rand(C).to(dt), rand(C).to(dt)
    grad_tol = LN_GRAD_TOL * (10 if C == 1 else 1)
    if kind == "layernorm":
        compare_dtypes(lambda x, w, b: kernels.layernorm(x, w, b, out_dtype=out),
                       lambda x, w, b: F.layer_norm(x, (C,), w, b, 1e-5), LN_TOL, grad_tol, out, x=x, w=w, b=b)
    else:
        compare_dtypes(lambda x, w: kernels.rmsnorm(x, w, out_dtype=out),
                       lambda x, w: F.rms_norm(x, (C,), w, 1e-5), LN_TOL, grad_tol, out, x=x, w=w)


for _kind in ("layernorm", "rmsnorm"):
    for _shape, _mode in (((1, 1), "bf16"), ((37, 127), "bf16"), ((2, 7, 768), "bf16"), ((3, 4097), "bf16"),
                          ((37, 768), "fp32_to_bf16"), ((1, 127), "fp32_to_bf16"), ((3, 4097), "fp32_to_bf16"),
                          ((37, 768), "bf16_to_fp32")):
        add(f"{_kind}_bf16/" + "x".join(map(str, _shape)) + f"_{_mode}" * (_mode != "bf16"), t_norm_bf16, _kind,
            _shape, _mode)


def t_add_norm_bf16(kind, shape, mode):
    """add_layernorm / add_rmsnorm with bf16: mode 'fp32_to_bf16' is mixed-precision training (fp32 stream x
    and sum s, bf16 sublayer output y and norm), 'bf16' is bf16 decoding (all bf16). The sum is rounded to
    the stream's dtype, by our kernel and by a separate add alike; the float64 reference rounds it too
    (forward only), or that one rounding, scaled up by the norm, would dominate the comparison."""
    dt, out = NORM_MODES[mode]
    C = shape[-1]
    x, y, w, b = rand(*shape).to(dt), rand(*shape).to(out), rand(C).to(dt), rand(C).to(dt)
    grad_tol = LN_GRAD_TOL * (10 if C == 1 else 1)

    def twin(x, y, w, b=None):
        s = x + y
        s = s + (s.to(dt).to(s.dtype) - s).detach()
        return s, (F.layer_norm(s, (C,), w, b, 1e-5) if b is not None else F.rms_norm(s, (C,), w, 1e-5))
    if kind == "layernorm":
        compare_dtypes(lambda x, y, w, b: kernels.add_layernorm(x, y, w, b, out_dtype=out), twin, LN_TOL, grad_tol,
                       (dt, out), x=x, y=y, w=w, b=b)
    else:
        compare_dtypes(lambda x, y, w: kernels.add_rmsnorm(x, y, w, out_dtype=out), twin, LN_TOL, grad_tol, (dt, out),
                       x=x, y=y, w=w)


for _kind in ("layernorm", "rmsnorm"):
    for _shape, _mode in (((37, 768), "fp32_to_bf16"), ((1, 127), "fp32_to_bf16"), ((3, 9001), "fp32_to_bf16"),
                          ((2, 7, 768), "bf16"), ((37, 1), "bf16"), ((3, 9001), "bf16"),
                          ((2, 16388), "bf16")):  # 4-wide bf16 rows past the register cache (16384 columns)
        add(f"add_{_kind}_bf16/" + "x".join(map(str, _shape)) + f"_{_mode}" * (_mode != "bf16"), t_add_norm_bf16,
            _kind, _shape, _mode)


def t_norm_views(dt):
    # the norms' gradients for x and weight given as views (a transposed x, a strided weight), against the
    # float64 reference: the backward reads its rows from contiguous copies
    C = 37
    x = rand(4, C, 6).transpose(1, 2).to(dt)
    w, b = rand(2 * C)[::2].to(dt), rand(C).to(dt)
    tol = (2e-2, 2e-2) if dt == BF16 else 1e-4
    compare_dtypes(*on_both(lambda ops, x, w, b: ops.layernorm(x, w, b)), tol, tol, out_dtype=dt, x=x, w=w, b=b)
    compare_dtypes(*on_both(lambda ops, x, w: ops.rmsnorm(x, w)), tol, tol, out_dtype=dt, x=x, w=w)


for _dt, _tag in ((torch.float32, "fp32"), (BF16, "bf16")):
    add(f"dispatcher/norm_views_{_tag}", t_norm_views, _dt)


def t_stress_norm(kind, R, C, dtype):
    x, w, b = (rand(*shape).to(dtype).requires_grad_() for shape in ((R, C), (C,), (C,)))
    if kind == "layernorm":
        return stress(lambda: grads(kernels.layernorm(x, w, b), [x, w, b]))
    return stress(lambda: grads(kernels.rmsnorm(x, w), [x, w]))


for _dt, _tag in ((torch.float32, "fp32"), (BF16, "bf16")):
    add(f"stress/layernorm_3000x1000_{_tag}", t_stress_norm, "layernorm", 3000, 1000, _dt)
# rows that are not 16-byte multiples; a warp a row
add("stress/rmsnorm_5000x388_fp32", t_stress_norm, "rmsnorm", 5000, 388, torch.float32)


bad_inputs(
    ("layernorm_cpu_x", RuntimeError, lambda: kernels.layernorm(torch.randn(4, 8), rand(8), rand(8)),
     ("layernorm", "x")),
    ("layernorm_weight_size", RuntimeError, lambda: kernels.layernorm(rand(4, 8), rand(7), rand(8)),
     ("layernorm", "weight")),
    ("rmsnorm_weight_size", RuntimeError, lambda: kernels.rmsnorm(rand(4, 8), rand(7)), ("rmsnorm", "weight")),
    ("rmsnorm_cpu_x", RuntimeError, lambda: kernels.rmsnorm(torch.randn(4, 8), rand(8)), ("rmsnorm", "x")),
    # bf16: one dtype for an op's inputs, and out_dtype float32 or bfloat16
    ("layernorm_bf16_weight_float32_x", RuntimeError,
     lambda: kernels.layernorm(rand(4, 8), rand(8).bfloat16(), rand(8)), ("layernorm", "weight", "Float")),
    ("layernorm_out_float16", ValueError,
     lambda: kernels.layernorm(rand(4, 8), rand(8), rand(8), out_dtype=torch.float16), ("layernorm", "out_dtype")),
    ("rmsnorm_float16_x", RuntimeError, lambda: kernels.rmsnorm(rand(4, 8).half(), rand(8).half()), ("rmsnorm", "x")),
    # the residual add: y has x's shape, the norm's output dtype, x's device
    ("add_layernorm_y_shape", RuntimeError, lambda: kernels.add_layernorm(rand(4, 8), rand(4, 7), rand(8), rand(8)),
     ("add_layernorm", "y", "shape")),
    ("add_layernorm_y_float32_out_bf16", RuntimeError,
     lambda: kernels.add_layernorm(rand(4, 8), rand(4, 8), rand(8), rand(8), out_dtype=torch.bfloat16),
     ("add_layernorm", "y", "BFloat16", "out_dtype")),
    ("add_layernorm_y_none", RuntimeError, lambda: kernels.add_layernorm(rand(4, 8), None, rand(8), rand(8)),
     ("add_layernorm", "y")),
    ("add_rmsnorm_y_none_x_requires_grad", RuntimeError,  # autograd's path would have read None as no addend
     lambda: kernels.add_rmsnorm(rand(4, 8).requires_grad_(), None, rand(8)), ("add_rmsnorm", "y", "None")),
    ("layernorm_bias_none", RuntimeError,  # norm_forward would read an undefined bias as RMSNorm
     lambda: kernels.layernorm(rand(4, 8), rand(8), None), ("layernorm", "bias", "None")),
    ("add_layernorm_bias_none_x_requires_grad", RuntimeError,
     lambda: kernels.add_layernorm(rand(4, 8).requires_grad_(), rand(4, 8), rand(8), None),
     ("add_layernorm", "bias", "None")),
    ("add_layernorm_bf16_x_float32_y", RuntimeError,
     lambda: kernels.add_layernorm(rand(4, 8).bfloat16(), rand(4, 8), rand(8).bfloat16(), rand(8).bfloat16(),
                                   out_dtype=torch.float32), ("add_layernorm", "y", "bfloat16")),
    ("add_rmsnorm_cpu_y", RuntimeError, lambda: kernels.add_rmsnorm(rand(4, 8), torch.randn(4, 8), rand(8)),
     ("add_rmsnorm", "y")),
    ("add_rmsnorm_bf16_x_float32_weight", RuntimeError,
     lambda: kernels.add_rmsnorm(rand(4, 8).bfloat16(), rand(4, 8).bfloat16(), rand(8)), ("add_rmsnorm", "weight")),
)


@opcheck_args
def opcheck_norms(dt):
    x, C, plain, k = _leaf(5, 7, 37, dtype=dt), 37, _plain(dt), torch.ops.kernels
    w, b, y = _leaf(C, dtype=dt), _leaf(C, dtype=dt), _leaf(5, 7, C, dtype=dt)
    cases = [("layernorm", k.layernorm, (x, w, b), {}), ("rmsnorm", k.rmsnorm, (x, w), {"eps": 1e-6}),
             ("add_layernorm", k.add_layernorm, (x, y, w, b), {}), ("add_rmsnorm", k.add_rmsnorm, (x, y, w), {}),
             ("norm_forward", k.norm_forward, (plain(5, 37), None, plain(37), plain(37), 1e-5, None), {})]
    if dt == torch.float32:  # the mixed-precision form: an fp32 stream normalised into bf16
        y16 = _leaf(5, 7, C, dtype=BF16)
        cases.append(("add_layernorm_bf16_out", k.add_layernorm, (x, y16, w, b), {"out_dtype": BF16}))
    cases.append(("layernorm_transposed_x", k.layernorm, (_leaf(4, 37, 6, dtype=dt).transpose(1, 2), w, b), {}))
    r = k.norm_forward(plain(5, 37), None, plain(37), plain(37), 1e-5, None)  # y, rstd, mean
    cases.append(("norm_backward", k.norm_backward, (plain(5, 37), plain(37), r[2], r[1], plain(5, 37), None, dt,
                                                      False), {}))
    return cases


@bench_rows("ops")
def bench_norms(rows):
    # the mixed-precision norm (fp32 residual in, bf16 out) against what autocast runs for it, layer_norm in fp32
    # and the cast the next matmul makes; bf16 in and out against PyTorch's bf16 op
    bf = BF16
    R, C = 16384, 768  # the large preset's tokens per step and a 768-wide model
    x32, w32, b32 = rand(R, C), rand(C), rand(C)
    bench_op(rows, "layernorm fp32->bf16", f"{R}x{C}", "fwd",
             lambda ops, x, w, b: kernels.layernorm(x, w, b, out_dtype=bf) if ops is kernels
             else F.layer_norm(x, (C,), w, b).to(bf), [x32, w32, b32], (4 + 2) * R * C, "GB/s", tol=1e-2)
    bench_bf16_rows(rows, "layernorm bf16", lambda ops, x, w, b: ops.layernorm(x, w, b),
                    [x32.to(bf), w32.to(bf), b32.to(bf)])
    # The residual add that ends a sublayer with the norm that starts the next, at the large preset's shape
    # (16384 tokens, 384 wide): fp32 stream + bf16 sublayer output -> fp32 stream, bf16 norm; against
    # what autocast runs, the add, layer_norm in fp32 and the next matmul's cast. fwd reads x, y and writes
    # s, y_norm (12 bytes an element); bwd reads s, dy_norm, ds and writes dx, dy (16), and the weight
    # gradients read s and dy_norm again (6)
    R2, C2 = 16384, 384
    ins = [rand(R2, C2), rand(R2, C2).to(bf), rand(C2), rand(C2)]

    def add_ln(ops, x, y, w, b):
        if ops is kernels:
            return kernels.add_layernorm(x, y, w, b, out_dtype=bf)
        s = x + y
        return s, F.layer_norm(s, (C2,), w, b).to(bf)
    bench_op(rows, "add_layernorm fp32+bf16", f"{R2}x{C2}", "fwd", add_ln, ins, 12 * R2 * C2, "GB/s", tol=1e-2)
    bench_op(rows, "add_layernorm fp32+bf16", f"{R2}x{C2}", "bwd", add_ln, ins, 22 * R2 * C2, "GB/s", tol=1e-2)

    def w_b(x):  # a norm's weight and bias for the rows of x
        return [rand(x.shape[-1]), rand(x.shape[-1])]
    # rows moved (fwd, bwd): add_layernorm reads x, y and writes s, y_norm; its backward reads s, dy_norm
    # and ds and writes dx (which is also dy)
    bench_row_ops(rows, (("layernorm", lambda ops, x, w, b: ops.layernorm(x, w, b), lambda x: [x, *w_b(x)]),
                         ("rmsnorm", lambda ops, x, w: ops.rmsnorm(x, w), lambda x: [x, w_b(x)[0]]),
                         ("add_layernorm", lambda ops, x, y, w, b: ops.add_layernorm(x, y, w, b),
                          lambda x: [x, rand(*x.shape), *w_b(x)])),
                  moved={"add_layernorm": (4, 4)})


# ==== op: embedding ====
# embedding against its float64 twin: the forward exact, the weight gradient's sums over repeated indices
# (bit for bit twice), fp32 and bf16, padding_idx, bad indices; its bad inputs, opcheck arguments, stress
# and bench.


def embedding_reference(idx, w, padding_idx=None):
    """F.embedding's value through index_select, whose backward is an index_add; padding_idx's positions
    read the row detached, so that it gets no gradient. PyTorch's own embedding backward takes, for 1025 to
    3072 indices, a kernel that reloads its shared index list for the next 1024 indices with no barrier
    after the warps still reading it (pytorch/pytorch#187687): under compute-sanitizer's timing that race
    gives a wrong gradient, so it cannot be the reference."""
    rows = w.index_select(0, idx.reshape(-1)).view(*idx.shape, w.shape[-1])
    if padding_idx is None:
        return rows
    pad = (idx == padding_idx % w.shape[0]).unsqueeze(-1)
    return torch.where(pad, rows.detach(), rows)


REF.embedding = embedding_reference


# forward is a copy: exact. A weight-gradient row sums one dy row per use of its index, in token
# order: fp32 rounding grows with the count
EMB_GRAD_TOL_PER_USE = 1e-6


def t_embedding(idx_shape, V, C):
    idx = torch.randint(0, V, idx_shape, device=DEV)
    flat = idx.view(-1)
    flat[::3] = V - 1  # one index repeated many times, and the last row
    flat[-1] = 0
    uses = torch.bincount(flat).max().item()
    compare(lambda ops, idx, w: ops.embedding(idx, w), 0.0, EMB_GRAD_TOL_PER_USE * uses, idx=idx, w=rand(V, C))


for _idx_shape, _V, _C in (((7,), 50, 33), ((16, 33), 10, 768), ((1,), 1, 1), ((4, 64), 50304, 64),
                           ((1,), 7, 5), ((3, 1001), 1, 5), ((4097,), 65, 129), ((8192,), 3, 768)):
    add(f"embedding/{'x'.join(map(str, _idx_shape))}_of_{_V}x{_C}", t_embedding, _idx_shape, _V, _C)


def t_embedding_wide(idx_shape, V, C):
    # The backward's column tiles (256 units) run over grid.y, which stops at 65535: an odd C (one-wide
    # loads) of 16777217 makes 65537 tiles, which the blocks walk a grid apart (one launch of them all
    # failed). 40 indices of 3 make runs that cross the chunks of 32, so both backward kernels walk them.
    past_grid_limit()
    t_embedding(idx_shape, V, C)


add("embedding/40_of_3x16777217_column_tiles_past_grid_y", t_embedding_wide, (40,), 3, 16777217)


def t_embedding_deterministic(n, V, C, run=None):
    # Two backward passes give bitwise the same weight gradient. The backward sorts the indices and
    # cuts the sorted list into chunks of 32: few distinct indices make runs that span many chunks;
    # run=r makes every run exactly r long (r = 32: runs end on chunk boundaries), in shuffled order.
    idx = (torch.arange(n, device=DEV) // run)[torch.randperm(n, device=DEV)] if run else \
        torch.randint(0, V, (n,), device=DEV)
    w, dy = rand(V, C).requires_grad_(), rand(n, C)
    dws = [torch.autograd.grad(kernels.embedding(idx, w), w, dy)[0] for _ in range(2)]
    assert torch.equal(dws[0], dws[1]), \
        f"two backward passes differ, by up to {(dws[0] - dws[1]).abs().max().item():.2e}"
    ref = torch.zeros(V, C, dtype=torch.float64, device=DEV).index_add_(0, idx, dy.double())
    check("dw", dws[0], ref, EMB_GRAD_TOL_PER_USE * torch.bincount(idx, minlength=V).max().item())
    return "bitwise identical twice"


for _n, _V, _C, _run in ((8192, 3, 768, None), (8192, 3, 7, None), (5000, 1, 33, None), (1, 1, 1, None),
                         (1, 5, 64, None), (1000, 50304, 64, None), (96, 3, 64, 32), (99, 3, 5, 33),
                         (4096, 128, 128, 32)):
    add(f"embedding/bwd_deterministic_{_n}_of_{_V}x{_C}" + f"_runs{_run}" * bool(_run), t_embedding_deterministic,
        _n, _V, _C, _run)


def t_embedding_bf16(idx_shape, V, C):
    idx = torch.randint(0, V, idx_shape, device=DEV)
    uses = int(torch.bincount(idx.view(-1), minlength=V).max())
    # forward: a copy, exact (asserted bit for bit); backward: fp32 sums rounded once to bf16
    w = rand(V, C).to(BF16)
    assert torch.equal(kernels.embedding(idx, w), F.embedding(idx, w)), "the bf16 embedding forward is not exact"
    compare_dtypes(*on_both(lambda ops, w: ops.embedding(idx, w)), 0.0, EMB_GRAD_TOL_PER_USE * uses, w=w)


add("embedding_bf16/3x1001_of_1000x64", t_embedding_bf16, (3, 1001), 1000, 64)
add("embedding_bf16/7_of_5x13", t_embedding_bf16, (7,), 5, 13)


def t_embedding_padding(idx_shape, V, C, padding_idx, appears, dtype=torch.float32):
    """padding_idx (negative: counted from the end) gets no gradient, exactly zero, whether its row appears in
    idx (often: runs of it across the backward's chunks of 32) or not; the others' within tolerance of the
    twin's (float64), bitwise the same twice. (Not bitwise the gradient without padding_idx: the padding
    positions leave the sorted list, so the chunks of 32 that cut the other runs move, and with them the order
    of a run's sums.) The forward copies the padding row as any other."""
    pad = padding_idx % V
    idx = torch.randint(0, V, idx_shape, device=DEV)
    flat = idx.view(-1)
    if appears:
        flat[::3] = pad
    else:
        flat[flat == pad] = (pad + 1) % V
    w = rand(V, C).to(dtype)
    uses = max(1, int(torch.bincount(flat, minlength=V).index_fill(0, torch.tensor(pad, device=DEV), 0).max()))
    f = lambda ops, w: ops.embedding(idx, w, padding_idx=padding_idx)
    if dtype == torch.float32:
        compare(f, 0.0, EMB_GRAD_TOL_PER_USE * uses, w=w)
    else:
        compare_dtypes(*on_both(f), 0.0, EMB_GRAD_TOL_PER_USE * uses, w=w)
    w = w.requires_grad_()
    dy = rand(*idx_shape, C).to(dtype)
    out = kernels.embedding(idx, w, padding_idx=padding_idx)
    assert torch.equal(out, w.detach()[idx]), "the forward is not weight's rows, the padding row's included"
    dw, dw_again = (torch.autograd.grad(kernels.embedding(idx, w, padding_idx=padding_idx), w, dy)[0]
                    for _ in range(2))
    assert torch.equal(dw[pad], torch.zeros_like(dw[pad])), \
        f"padding row {pad} got gradient, up to {dw[pad].abs().max().item():.2e}"
    assert torch.equal(dw, dw_again), "two backward passes differ"
    return f"row {pad} of {V}: {int((flat == pad).sum())} uses, zero gradient; bitwise identical twice"


for _idx_shape, _V, _C, _pad, _appears in (((7,), 50, 33, 3, True), ((16, 33), 10, 768, -1, True),
                                           ((4097,), 65, 129, 0, True), ((5,), 7, 5, -7, False),
                                           ((1,), 1, 1, 0, True), ((3, 1001), 1000, 64, 999, False)):
    add(f"embedding/padding_idx{_pad}_{'x'.join(map(str, _idx_shape))}_of_{_V}x{_C}" + "_absent" * (not _appears),
        t_embedding_padding, _idx_shape, _V, _C, _pad, _appears)
add("embedding_bf16/padding_idx-2_3x1001_of_1000x64", t_embedding_padding, (3, 1001), 1000, 64, -2, True, BF16)


@mutant("embedding_padding_row_gets_gradient", "embedding/padding_idx3_7_of_50x33",
        "embedding/padding_idx-1_16x33_of_10x768", "embedding/padding_idx0_4097_of_65x129",
        "embedding_bf16/padding_idx-2_3x1001_of_1000x64")
def _embedding_padding_row_gets_gradient():
    # padding_idx dropped: its row's positions summed into its gradient like any other's
    real = kernels.embedding
    with unittest.mock.patch.object(kernels, "embedding", lambda idx, w, padding_idx=None: real(idx, w)):
        yield


def bad_embedding_idx(bad):
    V, C = 65, 33
    w, dy = rand(V, C).requires_grad_(), rand(2, 3, C)
    idx = torch.tensor([[3, bad, 64], [0, 5, 3]], device=DEV)
    out = kernels.embedding(idx, w)  # no error yet: the indices are only read on the device
    good = (idx >= 0) & (idx < V)
    assert out[~good].isnan().all(), f"the row of idx {bad} is not NaN: {out[~good]}"
    assert torch.equal(out[good], w.detach()[idx[good]]), "the other rows are not weight's"
    # the backward drops the bad token and sums the others
    dw = torch.autograd.grad(out, w, dy)[0]
    ref = torch.zeros(V, C, dtype=torch.float64, device=DEV).index_add_(0, idx[good], dy[good].double())
    check("dw", dw, ref, 1e-6 * 3)
    expect_index_error(lambda: kernels.layernorm(rand(2, 4), rand(4), rand(4)), "embedding", "idx", bad, V)
    kernels.embedding(idx, w)
    return one_line(expect_index_error(kernels.check_errors, "embedding", "idx", bad, V))


for _bad in (-1, 65):
    add(f"embedding/bad_idx_{_bad}", bad_embedding_idx, _bad)


def t_stress_embedding(idx_shape, V, C, dtype):
    idx = torch.randint(0, V, idx_shape, device=DEV)
    w = rand(V, C).to(dtype).requires_grad_()
    return stress(lambda: grads(kernels.embedding(idx, w), [w]))


for _dt, _tag in ((torch.float32, "fp32"), (BF16, "bf16")):
    add(f"stress/embedding_3x1001_of_1000x64_{_tag}", t_stress_embedding, (3, 1001), 1000, 64, _dt)
# runs that span many 32-position chunks
add("stress/embedding_4097_of_5x129_fp32", t_stress_embedding, (4097,), 5, 129, torch.float32)


def t_stress_embedding_padding():
    # the padding row's positions dropped from the sorted runs, in a graph too
    idx = torch.randint(0, 5, (4097,), device=DEV)
    w = rand(5, 129).requires_grad_()
    return stress(lambda: grads(kernels.embedding(idx, w, padding_idx=2), [w]))


add("stress/embedding_4097_of_5x129_padding_idx", t_stress_embedding_padding)


bad_inputs(
    # int64 indices on the GPU and a 2-D weight (also through autograd, where the weight requires grad)
    ("embedding_int32_idx", RuntimeError, lambda: kernels.embedding(_pos(3, 1).int(), rand(5, 8)),
     ("embedding", "idx", "int64")),
    ("embedding_float_idx_weight_requires_grad", RuntimeError,
     lambda: kernels.embedding(rand(2), rand(5, 8).requires_grad_()), ("embedding", "idx", "int64")),
    ("embedding_cpu_idx", RuntimeError, lambda: kernels.embedding(torch.tensor([3, 1]), rand(5, 8)),
     ("embedding", "idx", "CUDA")),
    ("embedding_cpu_weight", RuntimeError, lambda: kernels.embedding(_pos(3, 1), torch.randn(5, 8)),
     ("embedding", "weight", "CUDA")),
    ("embedding_1d_weight", RuntimeError, lambda: kernels.embedding(_pos(3, 1), rand(8)),
     ("embedding", "weight", "2-D")),
    ("embedding_3d_weight", RuntimeError, lambda: kernels.embedding(_pos(3, 1), rand(2, 5, 8)),
     ("embedding", "weight", "2-D")),
    ("embedding_float64_weight", RuntimeError, lambda: kernels.embedding(_pos(3, 1), rand(5, 8).double()),
     ("embedding", "weight", "float32")),
    # padding_idx in [-num_embeddings, num_embeddings), as F.embedding's, an int
    ("embedding_padding_idx_past_the_end", ValueError, lambda: kernels.embedding(_pos(3, 1), rand(5, 8), padding_idx=5),
     ("embedding", "padding_idx", "num_embeddings", "5")),
    ("embedding_padding_idx_before_the_start_weight_requires_grad", ValueError,
     lambda: kernels.embedding(_pos(3, 1), rand(5, 8).requires_grad_(), padding_idx=-6),
     ("embedding", "padding_idx", "num_embeddings", "6")),
    ("embedding_float_padding_idx", RuntimeError, lambda: kernels.embedding(_pos(3, 1), rand(5, 8), padding_idx=1.5),
     ("embedding", "padding_idx")),
)


@opcheck_args
def opcheck_embedding(dt):
    plain, k = _plain(dt), torch.ops.kernels
    idx = torch.randint(0, 11, (3, 7), device=DEV)
    return [("embedding", k.embedding, (idx, _leaf(11, 37, dtype=dt)), {}),
            ("embedding_padding_idx", k.embedding, (idx, _leaf(11, 37, dtype=dt)), {"padding_idx": -2}),
            ("embedding_backward", k.embedding_backward, (idx, plain(3, 7, 37), 11, None), {}),
            ("embedding_backward_padding_idx", k.embedding_backward, (idx, plain(3, 7, 37), 11, 9), {})]


@bench_rows("ops")
def bench_embedding(rows):
    V, C, T = 50304, 768, 16 * 64
    idx, w = torch.randint(0, V, (16, 64), device=DEV), rand(V, C)
    # the weight gradient is a dense V x C table: writing it dominates the backward
    for pas, nbytes in (("fwd", 4 * 2 * T * C), ("bwd", 4 * (T * C + V * C))):
        bench_op(rows, "embedding", f"16x64 of {V}x{C}", pas, lambda ops, idx, w: ops.embedding(idx, w),
                 [idx, w], nbytes, "GB/s")


# ==== op: cross_entropy ====
# cross_entropy against its float64 twin, loss and logits' gradient, vocabularies up to 50304, NaN and inf
# as the twin's, fp32 and bf16, ignored targets, bad targets; its bad inputs, opcheck arguments, stress and
# bench rows.


# the loss is ~log V; gradients are (p - onehot) / N, down to ~1e-9, hence the relative part
CE_TOL, CE_GRAD_TOL = (1e-5, 1e-5), (1e-8, 1e-5)


def t_cross_entropy(N, V, scale=1.0):
    targets = torch.randint(0, V, (N,), device=DEV)
    targets[0], targets[-1] = V - 1, 0
    compare(lambda ops, logits, targets: ops.cross_entropy(logits, targets), CE_TOL, CE_GRAD_TOL,
            logits=rand(N, V, scale=scale), targets=targets)


for _N, _V, _scale in ((1, 65, 1), (37, 65, 1), (1, 50304, 1), (37, 50304, 1), (37, 65, 30)):
    add(f"cross_entropy/{_N}x{_V}" + f"_x{_scale}" * (_scale != 1), t_cross_entropy, _N, _V, _scale)


def t_cross_entropy_nonfinite(kind, N, V):
    """kind 'nan_inf': nonfinite_rows' logits, a NaN loss; 'neg_inf_off_target': -inf in every row, never at
    the target, a finite loss; 'neg_inf_at_target': also row 0's target at -inf (an infinite loss) and row 1
    -inf but at its target (a zero loss and zero gradient for that row)."""
    targets = torch.randint(0, V, (N,), device=DEV)
    inf = float("inf")
    if kind == "nan_inf":
        logits = nonfinite_rows(N, V)
    else:
        logits = rand(N, V)
        logits[torch.arange(N, device=DEV), (targets + 1) % V] = -inf
        if kind == "neg_inf_at_target":
            logits[0, targets[0]] = -inf
            logits[1] = -inf
            logits[1, targets[1]] = 0.5
    compare(lambda ops, logits, targets: ops.cross_entropy(logits, targets), CE_TOL, CE_GRAD_TOL, nonfinite=True,
            logits=logits, targets=targets)


for _kind, _V in (("nan_inf", 65), ("nan_inf", 50304), ("neg_inf_off_target", 65), ("neg_inf_at_target", 65)):
    add(f"cross_entropy/nonfinite_{_kind}_37x{_V}", t_cross_entropy_nonfinite, _kind, 37, _V)


def t_cross_entropy_bf16(N, V, scale=1.0):
    targets = torch.randint(0, V, (N,), device=DEV)
    targets[0], targets[-1] = V - 1, 0
    # the loss is fp32 from bf16 logits (autocast's choice); the logits' gradient is bf16
    compare_dtypes(*on_both(lambda ops, logits: ops.cross_entropy(logits, targets)), CE_TOL, CE_GRAD_TOL, torch.float32,
                   logits=rand(N, V, scale=scale).to(BF16))


for _N, _V, _scale in ((1, 65, 1), (37, 65, 1), (37, 50304, 1), (37, 65, 30)):
    add(f"cross_entropy_bf16/{_N}x{_V}" + f"_x{_scale}" * (_scale != 1), t_cross_entropy_bf16, _N, _V, _scale)


def t_cross_entropy_ignore(N, V, ignored, ignore_index=-100, dtype=torch.float32):
    """Rows whose target is ignore_index give no loss and no gradient (exactly zero), the mean is over the
    others, as F.cross_entropy(ignore_index=...)'s. ignored: 'some' (every third row from the second, and the
    last), 'all' (the loss NaN, as PyTorch's mean over no rows, and every gradient zero), 'none' (ignore_index a
    class no target takes: the mean over every row). An ignore_index in [0, V) is ignored wherever a target
    takes it; one outside is no bad target (the case's check_errors finds nothing)."""
    targets = torch.randint(0, V, (N,), device=DEV)
    targets[0], targets[-1] = V - 1, 0
    if ignored == "none":
        targets[targets == ignore_index] = (ignore_index + 1) % V
    else:
        rows = slice(None) if ignored == "all" else slice(1, None, 3)
        targets[rows] = ignore_index
        targets[-1] = ignore_index
    skip = targets == ignore_index
    f = lambda ops, logits: ops.cross_entropy(logits, targets, ignore_index=ignore_index)
    if dtype == torch.float32:
        compare(f, CE_TOL, CE_GRAD_TOL, nonfinite=ignored == "all", logits=rand(N, V))
    else:
        compare_dtypes(*on_both(f), CE_TOL, CE_GRAD_TOL, torch.float32, logits=rand(N, V).to(BF16))
    logits = rand(N, V).to(dtype).requires_grad_()
    loss = kernels.cross_entropy(logits, targets, ignore_index=ignore_index)
    dx = torch.autograd.grad(loss, logits)[0]
    assert torch.equal(dx[skip], torch.zeros_like(dx[skip])), \
        f"an ignored row got gradient, up to {dx[skip].abs().max().item():.2e}"
    return f"{int(skip.sum())} of {N} rows ignored, their gradient zero; loss {loss.item():.4f}"


# V 65, 1001, 50304: a warp, 256 threads and 1024 threads a row; N 3000: a thread of the mean counts
# several rows
for _N, _V, _ignored, _index in ((1, 65, "all", -100), (1, 65, "none", -100), (37, 65, "some", -100),
                                 (37, 65, "all", -100), (1000, 65, "some", 0), (37, 1001, "some", 1001),
                                 (37, 50304, "some", 3), (37, 50304, "none", 7), (5, 50304, "all", -1),
                                 (3000, 65, "some", -100)):  # past the mean kernel's 1024 threads
    add(f"cross_entropy/ignore_{_ignored}_{_N}x{_V}" + f"_index{_index}" * (_index != -100), t_cross_entropy_ignore,
        _N, _V, _ignored, _index)
for _N, _V, _ignored, _index in ((37, 65, "some", -100), (37, 50304, "some", 7), (1, 1001, "none", -100)):
    add(f"cross_entropy_bf16/ignore_{_ignored}_{_N}x{_V}" + f"_index{_index}" * (_index != -100),
        t_cross_entropy_ignore, _N, _V, _ignored, _index, BF16)


def t_cross_entropy_ignored_nonfinite():
    # NaN and inf in ignored rows reach neither the loss (as in PyTorch's) nor the gradient (PyTorch's is NaN
    # there: its log-softmax backward multiplies them by the rows' zero gradient; ours leaves the rows unread)
    N, V = 37, 65
    logits = nonfinite_rows(N, V).requires_grad_()
    targets = torch.randint(0, V, (N,), device=DEV)
    targets[:5] = -100  # nonfinite_rows' rows 0-4
    x64 = logits.detach().double().requires_grad_()
    loss, ref = kernels.cross_entropy(logits, targets), F.cross_entropy(x64, targets)
    check("loss", loss, ref, CE_TOL)
    dx, ref_dx = torch.autograd.grad(loss, logits)[0], torch.autograd.grad(ref, x64)[0]
    assert torch.equal(dx[:5], torch.zeros_like(dx[:5])), "an ignored row with NaN or inf got gradient"
    check("dlogits_kept_rows", dx[5:], ref_dx[5:], CE_GRAD_TOL)


add("cross_entropy/ignore_nonfinite_rows_37x65", t_cross_entropy_ignored_nonfinite)


@mutant("cross_entropy_ignored_rows_in_the_mean", "cross_entropy/ignore_some_37x65",
        "cross_entropy/ignore_some_37x50304_index3", "cross_entropy_bf16/ignore_some_37x65")
def _cross_entropy_ignored_rows_in_the_mean():
    # the mean's denominator counts the ignored rows too: loss and gradient scaled by kept / N
    real = kernels.cross_entropy

    def over_every_row(logits, targets, ignore_index=-100):
        return real(logits, targets, ignore_index=ignore_index) * (targets != ignore_index).sum() / targets.numel()
    with unittest.mock.patch.object(kernels, "cross_entropy", over_every_row):
        yield


def bad_cross_entropy_target(bad, ignore_index=-100):
    # with ignore_index 3, the rows whose target is 3 (some drawn, every fourth from the third set) are ignored:
    # the bad row still counts among the kept, whose count divides the others' gradient
    N, V, row = 37, 65, 5
    logits = rand(N, V).requires_grad_()
    targets = torch.randint(0, V, (N,), device=DEV)
    if ignore_index == 3:
        targets[2::4] = 3
    targets[row] = bad
    loss = kernels.cross_entropy(logits, targets, ignore_index=ignore_index)
    assert loss.isnan(), f"loss {loss.item()} with target {bad} is not NaN"
    dx = torch.autograd.grad(loss, logits)[0]
    assert dx[row].isnan().all(), f"the gradient of the row with target {bad} is not NaN"
    kept = targets != ignore_index
    keep = (torch.arange(N, device=DEV) != row) & kept
    x64 = logits.detach().double().requires_grad_()
    ref = torch.autograd.grad(F.cross_entropy(x64[keep], targets[keep], reduction="sum") / kept.sum(), x64)[0]
    check("dlogits_other_rows", dx[keep | ~kept], ref[keep | ~kept], CE_GRAD_TOL)
    expect_index_error(lambda: kernels.gelu(rand(3)), "cross_entropy", "targets", bad, V)
    kernels.cross_entropy(logits, targets, ignore_index=ignore_index)
    return one_line(expect_index_error(kernels.check_errors, "cross_entropy", "targets", bad, V))


for _bad in (-1, 65):
    add(f"cross_entropy/bad_target_{_bad}", bad_cross_entropy_target, _bad)
add("cross_entropy/bad_target_65_ignore_index3", bad_cross_entropy_target, 65, 3)


def t_stress_cross_entropy(N, V, dtype, ignored=False):
    # ignored: every third target -100 (the mean's count made on the device, in a graph too)
    logits, targets = rand(N, V).to(dtype).requires_grad_(), torch.randint(0, V, (N,), device=DEV)
    if ignored:
        targets[::3] = -100
    return stress(lambda: grads(kernels.cross_entropy(logits, targets), [logits]))


for _dt, _tag in ((torch.float32, "fp32"), (BF16, "bf16")):
    add(f"stress/cross_entropy_777x1001_{_tag}", t_stress_cross_entropy, 777, 1001, _dt)
    add(f"stress/cross_entropy_777x1001_ignored_{_tag}", t_stress_cross_entropy, 777, 1001, _dt, True)


bad_inputs(
    # int64 targets on the GPU, 2-D logits, one target a row (also through autograd, where the logits
    # require grad)
    ("cross_entropy_int32_targets", RuntimeError, lambda: kernels.cross_entropy(rand(4, 7), _pos(0, 1, 2, 3).int()),
     ("cross_entropy", "targets", "int64")),
    ("cross_entropy_float_targets_logits_requires_grad", RuntimeError,
     lambda: kernels.cross_entropy(rand(4, 7).requires_grad_(), rand(4)), ("cross_entropy", "targets", "int64")),
    ("cross_entropy_cpu_targets", RuntimeError, lambda: kernels.cross_entropy(rand(4, 7), torch.tensor([0, 1, 2, 3])),
     ("cross_entropy", "targets", "CUDA")),
    ("cross_entropy_cpu_logits", RuntimeError, lambda: kernels.cross_entropy(torch.randn(4, 7), _pos(0, 1, 2, 3)),
     ("cross_entropy", "logits", "CUDA")),
    ("cross_entropy_float64_logits", RuntimeError, lambda: kernels.cross_entropy(rand(4, 7).double(), _pos(0, 1, 2, 3)),
     ("cross_entropy", "logits", "float32")),
    ("cross_entropy_3d_logits", RuntimeError, lambda: kernels.cross_entropy(rand(2, 4, 7), _pos(0, 1)),
     ("cross_entropy", "logits", "2-D")),
    ("cross_entropy_2d_targets", RuntimeError, lambda: kernels.cross_entropy(rand(4, 7), _pos(0, 1, 2, 3).view(4, 1)),
     ("cross_entropy", "targets", "shape")),
    ("cross_entropy_N_mismatch", RuntimeError, lambda: kernels.cross_entropy(rand(4, 7), _pos(0, 1, 2)),
     ("cross_entropy", "targets", "shape")),
    ("cross_entropy_N_mismatch_logits_requires_grad", RuntimeError,
     lambda: kernels.cross_entropy(rand(4, 7).requires_grad_(), _pos(0, 1, 2, 3, 4)), ("cross_entropy", "targets")),
    # ignore_index an int (any int: PyTorch's too)
    ("cross_entropy_float_ignore_index", RuntimeError,
     lambda: kernels.cross_entropy(rand(4, 7), _pos(0, 1, 2, 3), ignore_index=1.5), ("cross_entropy", "ignore_index")),
    ("cross_entropy_none_ignore_index_logits_requires_grad", RuntimeError,
     lambda: kernels.cross_entropy(rand(4, 7).requires_grad_(), _pos(0, 1, 2, 3), ignore_index=None),
     ("cross_entropy", "ignore_index")),
)


@opcheck_args
def opcheck_cross_entropy(dt):
    plain, k = _plain(dt), torch.ops.kernels
    tgt = torch.randint(0, 37, (9,), device=DEV)
    tgt[2] = -100
    tgt5 = tgt.clone()
    tgt5[2] = 5
    _, lse, kept = k.cross_entropy_forward(plain(9, 37), tgt, -100)
    return [("cross_entropy", k.cross_entropy, (_leaf(9, 37, dtype=dt), tgt), {}),
            ("cross_entropy_ignore_index", k.cross_entropy, (_leaf(9, 37, dtype=dt), tgt5), {"ignore_index": 5}),
            ("cross_entropy_forward", k.cross_entropy_forward, (plain(9, 37), tgt, -100), {}),
            ("cross_entropy_backward", k.cross_entropy_backward,
             (plain(9, 37), tgt, lse, kept, torch.ones((), device=DEV), -100), {})]


@bench_rows("ops")
def bench_cross_entropy(rows):
    bf = BF16
    N, V = 16384, 65
    ins = [rand(N, V).to(bf), torch.randint(0, V, (N,), device=DEV)]
    for pas, nbytes in (("fwd", 2 * N * V), ("bwd", 4 * N * V)):
        bench_op(rows, "cross_entropy bf16", f"{N}x{V}", pas, lambda ops, logits, t: ops.cross_entropy(logits, t),
                 ins, nbytes, "GB/s", tol=1e-2)
    for N, V in ((8192, 65), (8192, 50304)):
        ins = [rand(N, V), torch.randint(0, V, (N,), device=DEV)]
        for pas, nbytes in (("fwd", 4 * N * V), ("bwd", 8 * N * V)):
            bench_op(rows, "cross_entropy", f"{N}x{V}", pas, lambda ops, logits, t: ops.cross_entropy(logits, t),
                     ins, nbytes, "GB/s")
    # Hugging Face's padded labels: half the rows -100, whose logits ours leave unread (bytes: the kept rows'
    # reads, every row's gradient written)
    N, V = 8192, 50304
    t = torch.randint(0, V, (N,), device=DEV)
    t[N // 2:] = -100
    for pas, nbytes in (("fwd", 4 * N * V // 2), ("bwd", 4 * N * V // 2 + 4 * N * V)):
        bench_op(rows, "cross_entropy", f"{N}x{V}, half ignored", pas,
                 lambda ops, logits, t: ops.cross_entropy(logits, t), [rand(N, V), t], nbytes, "GB/s")


# ==== op: gemv, expert_gemv (linear's one-row path) ====
# gemv, expert_gemv and linear's one-row GEMV against their float64 twins, fp32 and bf16, early launches
# (PDL) in a chain, bad experts; their bad inputs, opcheck arguments and bench rows.


def t_gemv(N, K, bias=False, x_step=1):
    w, x = rand(N, K), rand(K * x_step)[::x_step]
    if bias:
        compare(lambda ops, w, x, b: ops.gemv(w, x, b), mm_tol(K), w=w, x=x, b=rand(N))
    else:
        compare(lambda ops, w, x: ops.gemv(w, x), mm_tol(K), w=w, x=x)


for _N, _K, _bias, _step in ((1, 1, False, 1), (1, 1, True, 1), (3072, 768, False, 1), (3072, 768, True, 1),
                             (4096, 4096, False, 1), (4096, 4096, True, 1), (37, 1001, False, 1),
                             (1000, 1001, True, 1), (3072, 768, True, 2)):
    add(f"gemv/{_N}x{_K}" + "_bias" * _bias + f"_xstep{_step}" * (_step != 1), t_gemv, _N, _K, _bias, _step)


# Programmatic dependent launch (kernels.set_pdl, on by default): on a compute capability 9.0 GPU our row,
# elementwise, embedding, GEMV, kv_write and attention-forward kernels may be launched while the kernel
# ahead of them runs, and wait inside for it. Here a LayerNorm of one 2^22-wide row (one block, a long
# time) writes, over memory that held NaN just before (the caching allocator hands the freed block
# back: checked), the x of a GEMV that is launched as soon as that block starts; then a LayerNorm, a
# GEMV and a cross-entropy, each reading what the one before wrote. A kernel that read before its
# wait would see NaN or stale values; with launches early and ordinary, the same bits.
def t_gemv_pdl_chain(N, K):
    if torch.cuda.get_device_capability() != (9, 0):
        raise Skip("early launches need a compute capability 9.0 GPU")
    C = 1 << 22
    x, ln_w, ln_b = rand(C), rand(C), rand(C)
    w1, w2, ln2_w, ln2_b = rand(N, K), rand(N, N), rand(N), rand(N)
    tgt = torch.tensor([N // 3], device=DEV)

    def chain(pdl):
        kernels.set_pdl(pdl)
        try:
            poison = torch.full_like(x, float("nan"))
            ptr = poison.data_ptr()
            del poison
            h = kernels.layernorm(x, ln_w, ln_b)
            assert h.data_ptr() == ptr, "the norm's output did not reuse the NaN-filled block: nothing would be tested"
            y1 = kernels.gemv(w1, h[-K:])
            y2 = kernels.gemv(w2, kernels.layernorm(y1, ln2_w, ln2_b))
            return y1, y2, kernels.cross_entropy(y2[None], tgt)
        finally:
            kernels.set_pdl(True)
    early, ordinary = chain(True), chain(False)
    h_ref = REF.layernorm(x.double(), ln_w.double(), ln_b.double())[-K:]
    ref1 = REF.gemv(w1.double(), h_ref)
    ref2 = REF.gemv(w2.double(), REF.layernorm(ref1, ln2_w.double(), ln2_b.double()))
    check("gemv_after_long_norm", early[0], ref1, mm_tol(K))
    check("gemv_after_norm", early[1], ref2, mm_tol(K, N))
    check("cross_entropy_after_gemv", early[2], F.cross_entropy(ref2[None], tgt), mm_tol(K, N))
    for a, b, what in zip(early, ordinary, ("first GEMV", "second GEMV", "cross-entropy")):
        assert torch.equal(a, b), f"{what}: early launches changed the bits"


for _N, _K in ((1000, 1001), (3072, 768), (512, 8192)):  # scalar loads; 16-byte; 8 rounds of loads a lane
    add(f"gemv/pdl_chain_{_N}x{_K}", t_gemv_pdl_chain, _N, _K)


def t_linear_one_row(K, N, bias):
    # one row without autograd (decoding) takes the GEMV kernel inside kernels.linear
    with torch.no_grad():
        compare(lambda ops, x, w, b: ops.linear(x, w, b), mm_tol(K), x=rand(1, 1, K), w=rand(N, K),
                b=rand(N) if bias else None)


for _K, _N, _bias in ((768, 2304, True), (768, 95, False), (1001, 37, True)):
    add(f"linear/one_row_gemv_{_K}_to_{_N}" + "_bias" * _bias, t_linear_one_row, _K, _N, _bias)


def t_expert_gemv(E, N, K, experts, bias=True):
    e = torch.tensor(experts, device=DEV)
    compare(lambda ops, w, x, b, e: ops.expert_gemv(w, x, b, e), mm_tol(K), w=rand(E, N, K), x=rand(len(experts), K),
            b=rand(E, N) if bias else None, e=e)


for _E, _N, _K, _ex, _bias in ((8, 3072, 768, [5, 2], True), (8, 768, 3072, [7, 0], True), (1, 1, 1, [0], False),
                               (4, 37, 1001, [3, 3, 1], True)):
    add(f"expert_gemv/{_E}x{_N}x{_K}_experts{'-'.join(map(str, _ex))}" + "_bias" * _bias, t_expert_gemv,
        _E, _N, _K, _ex, _bias)


def t_expert_gemv_many_rows(S, E=4, N=37, K=64):
    # grid.y runs over the rows of x and stops at 65535: S = 2 * 65535 + 3 takes three launches, the last of 3
    # rows, each on its slice of x, y and experts (one launch of S rows failed: invalid configuration argument)
    past_grid_limit()
    e = torch.randint(0, E, (S,), device=DEV)
    compare(lambda ops, w, x, b, e: ops.expert_gemv(w, x, b, e), mm_tol(K), w=rand(E, N, K), x=rand(S, K),
            b=rand(E, N), e=e)


add("expert_gemv/131073_rows_past_grid_y", t_expert_gemv_many_rows, 131073)


def t_gemv_bf16(N, K, bias, experts=None):
    # decoding in bf16: bf16 weights and vector, fp32 sums over K, one rounding of the result
    tol = bf16_tol(K)[0]
    w = rand(*((4,) if experts else ()), N, K).to(BF16)
    b = (rand(4, N) if experts else rand(N)).to(BF16) if bias else None
    if experts:
        e = torch.tensor(experts, device=DEV)
        compare_dtypes(*on_both(lambda ops, w, x, b: ops.expert_gemv(w, x, b, e)), tol, w=w,
                       x=rand(len(experts), K).to(BF16), b=b)
    elif bias:
        compare_dtypes(*on_both(lambda ops, w, x, b: ops.linear(x, w, b)), tol, w=w, x=rand(1, K).to(BF16),
                       b=b)  # one row, no autograd: linear's GEMV path
    else:
        compare_dtypes(*on_both(lambda ops, w, x: ops.gemv(w, x)), tol, w=w, x=rand(K).to(BF16))


for _N, _K, _bias, _ex in ((1, 1, False, None), (3072, 768, False, None), (4096, 4096, False, None),
                           (37, 1001, False, None), (2304, 768, True, None), (95, 768, True, None),
                           (768, 3072, True, [3, 0]), (37, 1001, True, [1, 1, 2])):
    add(f"gemv_bf16/{_N}x{_K}" + "_bias" * _bias + ("_experts" + "-".join(map(str, _ex)) if _ex else ""),
        torch.no_grad()(t_gemv_bf16), _N, _K, _bias, _ex)


def bad_expert(bad):
    E, N, K = 4, 37, 1001
    w, x, b = rand(E, N, K), rand(3, K), rand(E, N)
    experts = torch.tensor([1, bad, 3], device=DEV)
    y = kernels.expert_gemv(w, x, b, experts)
    assert y[1].isnan().all(), f"the row of expert {bad} is not NaN"
    keep = torch.tensor([0, 2], device=DEV)
    check("other_rows", y[keep], REF.expert_gemv(w.double(), x[keep].double(), b.double(), experts[keep]), mm_tol(K))
    expect_index_error(lambda: kernels.topk(rand(4, 8), 2), "expert_gemv", "experts", bad, E)
    kernels.expert_gemv(w, x, b, experts)
    return one_line(expect_index_error(kernels.check_errors, "expert_gemv", "experts", bad, E))


for _bad in (-1, 4):
    add(f"expert_gemv/bad_expert_{_bad}", bad_expert, _bad)


bad_inputs(
    # bf16: one dtype for an op's inputs
    ("gemv_bf16_weight_float32_x", RuntimeError, lambda: kernels.gemv(rand(8, 4).bfloat16(), rand(4)),
     ("gemv", "x", "BFloat16")),
    ("expert_gemv_bf16_float32_bias", RuntimeError,
     lambda: kernels.expert_gemv(rand(2, 8, 4).bfloat16(), rand(1, 4).bfloat16(), rand(2, 8),
                                 torch.zeros(1, dtype=torch.long, device=DEV)), ("expert_gemv", "bias")),
    # shapes: gemv's one vector
    ("gemv_2d_x", RuntimeError, lambda: kernels.gemv(rand(8, 4), rand(1, 4)), ("gemv", "x", "shape")),
)


@opcheck_args
def opcheck_gemv(dt):
    plain, k = _plain(dt), torch.ops.kernels
    return [("linear_one_row", k.linear, (_leaf(37, dtype=dt), _leaf(19, 37, dtype=dt), _leaf(19, dtype=dt)), {}),
            ("gemv", k.gemv, (plain(19, 37), plain(37), plain(19)), {}),
            ("expert_gemv", k.expert_gemv, (plain(4, 19, 37), plain(3, 37), plain(4, 19),
                                            torch.tensor([3, 0, 3], device=DEV)), {})]


@bench_rows("ops")
def bench_gemv(rows):
    bf = BF16
    # decoding reads each weight once: bf16 halves the bytes of the fp32 rows below
    for N, K in ((3072, 768), (4096, 4096)):
        bench_op(rows, "gemv bf16", f"{N}x{K}+bias", "fwd", lambda ops, w, x, b: ops.gemv(w, x, b),
                 [rand(N, K).to(bf), rand(K).to(bf), rand(N).to(bf)], 2 * (N * K + K + 2 * N), "GB/s", tol=1e-2)
    for N, K in ((3072, 768), (4096, 4096)):
        bench_op(rows, "gemv", f"{N}x{K}+bias", "fwd", lambda ops, w, x, b: ops.gemv(w, x, b),
                 [rand(N, K), rand(K), rand(N)], 4 * (N * K + K + 2 * N), "GB/s")
    # MoE decoding: 2 of 8 experts' (3072, 768) weights; only those two are read (PyTorch gathers a copy)
    E, N, K, chosen = 8, 3072, 768, torch.tensor([5, 2], device=DEV)
    bench_op(rows, "expert_gemv", f"2 of {E}x{N}x{K}+bias", "fwd", lambda ops, w, x, b: ops.expert_gemv(w, x, b, chosen),
             [rand(E, N, K), rand(2, K), rand(E, N)], 4 * 2 * (N * K + K + 2 * N), "GB/s")


# ==== op: kv_write ====
# kv_write: the same bits as the torch op set's index_copy_ calls, fp32 and bf16, strided and padded rows,
# bad positions; its bad inputs and opcheck arguments.


# The KV cache write of decoding: the same bits as the torch op set's two index_copy_ calls. k and v
# are strided views of one QKV output, as the model passes them; positions in any order.
@torch.no_grad()
def t_kv_write(B, H, T, S, D, positions, dtype, pad=0):
    k_cache, v_cache = rand(B, H, S, D).to(dtype), rand(B, H, S, D).to(dtype)
    qkv = rand(B, T, 3 * H * D + pad).to(dtype)  # pad: rows off 16 bytes, so the kernel copies value by value
    k, v = (t.view(B, T, H, D).transpose(1, 2) for t in qkv.split(H * D, dim=-1)[1:3])  # (B, H, T, D) views
    pos = torch.tensor(positions, device=DEV)
    ours, ref = (k_cache.clone(), v_cache.clone()), (k_cache.clone(), v_cache.clone())
    kernels.kv_write(*ours, pos, k, v)
    train.torch_kv_write(*ref, pos, k, v)
    check("k_cache", ours[0], ref[0], 0.0)
    check("v_cache", ours[1], ref[1], 0.0)


for _B, _H, _T, _S, _D, _positions, _pad in ((1, 8, 1, 256, 96, [37], 0), (1, 16, 1, 1024, 128, [1023], 0),
                                       (2, 3, 5, 40, 64, [7, 2, 39, 0, 5], 0), (2, 4, 3, 50, 64, [49, 0, 17], 1),
                                       (1, 2, 3, 9, 5, [8, 0, 4], 0), (3, 1, 1, 1, 1, [0], 0)):
    for _dt in ("fp32", "bf16"):
        add(f"kv_write/{_dt}_b{_B}h{_H}t{_T}_cache{_S}_d{_D}" + "_padded" * _pad, t_kv_write, _B, _H, _T, _S, _D,
            _positions, torch.float32 if _dt == "fp32" else torch.bfloat16, _pad)


@torch.no_grad()
def bad_cache_position(bad):
    S = 16
    k_cache, v_cache = torch.zeros(1, 2, S, 8, device=DEV), torch.zeros(1, 2, S, 8, device=DEV)
    k, v = rand(1, 2, 2, 8), rand(1, 2, 2, 8)
    kernels.kv_write(k_cache, v_cache, torch.tensor([3, bad], device=DEV), k, v)
    assert torch.equal(k_cache[:, :, 3], k[:, :, 0]) and torch.equal(v_cache[:, :, 3], v[:, :, 0]), "row 3 not written"
    assert k_cache.count_nonzero() == 16 and v_cache.count_nonzero() == 16, "something besides row 3 was written"
    return one_line(expect_index_error(kernels.check_errors, "kv_write", "positions", bad, S))


for _bad in (-1, 16):
    add(f"kv_write/bad_position_{_bad}", bad_cache_position, _bad)


bad_inputs(
    # one dtype, shapes that fit the cache, contiguous caches, no gradient
    ("kv_write_bf16_k", RuntimeError,
     lambda: kernels.kv_write(rand(1, 2, 9, 8), rand(1, 2, 9, 8), _pos(3), rand(1, 2, 1, 8).bfloat16(),
                              rand(1, 2, 1, 8)),
     ("kv_write", "k", "Float", "k_cache")),
    ("kv_write_heads_mismatch", RuntimeError,
     lambda: kernels.kv_write(rand(1, 2, 9, 8), rand(1, 2, 9, 8), _pos(3), rand(1, 3, 1, 8), rand(1, 3, 1, 8)),
     ("kv_write", "k", "shape")),
    ("kv_write_positions_length", RuntimeError,
     lambda: kernels.kv_write(rand(1, 2, 9, 8), rand(1, 2, 9, 8), _pos(3, 4), rand(1, 2, 1, 8), rand(1, 2, 1, 8)),
     ("kv_write", "positions", "shape")),
    ("kv_write_int32_positions", RuntimeError,
     lambda: kernels.kv_write(rand(1, 2, 9, 8), rand(1, 2, 9, 8), _pos(3).int(), rand(1, 2, 1, 8),
                              rand(1, 2, 1, 8)),
     ("kv_write", "positions")),
    ("kv_write_strided_cache", RuntimeError,
     lambda: kernels.kv_write(rand(1, 2, 9, 16)[..., ::2], rand(1, 2, 9, 8), _pos(3), rand(1, 2, 1, 8),
                              rand(1, 2, 1, 8)), ("kv_write", "contiguous")),
    ("kv_write_cpu_cache", RuntimeError,
     lambda: kernels.kv_write(torch.randn(1, 2, 9, 8), rand(1, 2, 9, 8), _pos(3), rand(1, 2, 1, 8), rand(1, 2, 1, 8)),
     ("kv_write", "k_cache")),
    ("kv_write_v_shape", RuntimeError,
     lambda: kernels.kv_write(rand(1, 2, 9, 8), rand(1, 2, 9, 8), _pos(3), rand(1, 2, 1, 8), rand(1, 2, 2, 8)),
     ("kv_write", "v", "shape")),
    ("kv_write_strided_k", RuntimeError,
     lambda: kernels.kv_write(rand(1, 2, 9, 8), rand(1, 2, 9, 8), _pos(3), rand(1, 2, 1, 16)[..., ::2],
                              rand(1, 2, 1, 8)), ("kv_write", "k", "contiguous")),
    ("kv_write_grad", RuntimeError,
     lambda: kernels.kv_write(rand(1, 2, 9, 8), rand(1, 2, 9, 8), _pos(3), rand(1, 2, 1, 8).requires_grad_(),
                              rand(1, 2, 1, 8)), ("kv_write", "no_grad")),
)


@opcheck_args
def opcheck_kv_write(dt):
    plain, k = _plain(dt), torch.ops.kernels
    return [("kv_write", k.kv_write, (plain(2, 2, 16, 64), plain(2, 2, 16, 64), torch.tensor([4, 9], device=DEV),
                                      plain(2, 2, 2, 64), plain(2, 2, 2, 64)), {})]


# ==== op: topk ====
# topk: values and indices equal to the reference's order (ties by lower index, NaN on top) on every
# path, fp32 and bf16; its bad inputs, opcheck arguments and bench rows.


def topk_reference(x, k):
    """The order the spec promises and torch.topk leaves open (ties by lower index, NaN on top), in float64."""
    return train.torch_topk(x.double().cpu(), k)


def t_topk_bf16(shape, k):
    x = rand(*shape).to(BF16)
    values, idx = kernels.topk(x, k)
    ref_v, ref_i = topk_reference(x.float(), k)
    assert values.dtype == BF16, f"values dtype {values.dtype}"
    # bf16 rows tie often: the promised order (lower index first) is the test
    assert torch.equal(values.float().cpu(), ref_v.float()) and torch.equal(idx.cpu(), ref_i), "top-k differs"
    return f"{shape} k={k}: values and indices equal"


add("topk_bf16/37x1000_k5", t_topk_bf16, (37, 1000), 5)
add("topk_bf16/1x50304_k50", t_topk_bf16, (1, 50304), 50)


BIG = 2.0 ** 100  # stands in for NaN (2 * BIG for inf) in the value comparison; exact in fp32 and fp64


def t_topk(shape, k, kind=""):
    # ties: values from -4..4, so rows are full of ties and the index order is the test; zeros: +0
    # and -0 only, which tie; inf: +inf and -inf columns among the values; nan: two NaN columns and
    # row 1 all NaN (NaN ranks largest, NaNs by index)
    if kind == "ties":
        x = torch.randint(-4, 5, shape, device=DEV).float()
    elif kind == "zeros":
        x = torch.zeros(shape, device=DEV).masked_fill_(torch.rand(shape, device=DEV) < 0.5, -0.0)
    else:
        x = rand(*shape)
    if kind == "inf":
        x[:, ::3] = float("inf")
        x[:, 1::3] = float("-inf")
    if kind == "nan":
        x[:, 3] = float("nan")
        x[::2, -1] = float("nan")
        x[1:2] = float("nan")
    values, idx = kernels.topk(x, k)
    ref_values, ref_idx = topk_reference(x, k)
    assert values.dtype == torch.float32 and idx.dtype == torch.int64, f"dtypes {values.dtype}, {idx.dtype}"
    # NaN and +-inf stand in as finite numbers (an fp32 and an fp64 inf would not compare)
    check("values", values.double().nan_to_num(BIG, 2 * BIG, -2 * BIG), ref_values.nan_to_num(BIG, 2 * BIG, -2 * BIG),
          0.0)
    check("idx", idx, ref_idx, 0.0)
    if kind == "zeros":  # -0 and +0 tie, but each value is the one at its index
        assert torch.equal(values.signbit(), x.gather(-1, idx).signbit()), "sign of a zero lost"


# Paths: rows up to 512 with k <= 16 take one warp per row; otherwise one block holds a row of up to
# 8192; wider rows with few rows are split into slices of ~4096 and merged; a block whose share is
# wider than 8192 reads it in chunks (1 x 600000; 2048 rows of 8200 fill the GPU without splitting).
for _shape, _k, _kind in (((4096, 8), 1, ""), ((4096, 8), 2, ""), ((4096, 8), 8, ""), ((1, 50304), 50, ""),
                          ((37, 1000), 128, ""), ((2, 5, 300), 7, ""), ((5, 1), 1, ""), ((1, 1), 1, ""),
                          ((4096, 8), 2, "ties"), ((64, 1000), 128, "ties"), ((16, 100), 10, "nan"),
                          ((3, 16), 16, "ties"), ((3, 17), 17, ""), ((2, 512), 16, ""), ((2, 513), 16, "ties"),
                          ((4, 512), 17, "ties"), ((3, 128), 128, "nan"), ((5, 300), 64, "zeros"),
                          ((37, 1000), 128, "inf"), ((3, 8192), 128, "ties"), ((3, 8193), 128, "ties"),
                          ((1, 8193), 1, "zeros"), ((1, 50304), 50, "ties"), ((1, 50304), 50, "nan"),
                          ((1, 50304), 128, "zeros"), ((64, 50304), 50, ""), ((1, 262144), 128, ""),
                          ((1, 262144), 128, "ties"), ((1, 600000), 128, ""), ((1, 600000), 100, "nan"),
                          ((2048, 8200), 100, "ties")):
    add(f"topk/{'x'.join(map(str, _shape))}_k{_k}" + f"_{_kind}" * bool(_kind), t_topk, _shape, _k, _kind)


bad_inputs(
    ("topk_k_above_row", ValueError, lambda: kernels.topk(rand(4, 8), 9), ("k",)),
    ("topk_k_zero", ValueError, lambda: kernels.topk(rand(4, 8), 0), ("k",)),
    ("topk_k_above_128", ValueError, lambda: kernels.topk(rand(2, 1000), 129), ("k",)),
)


@opcheck_args
def opcheck_topk(dt):
    return [("topk", torch.ops.kernels.topk, (_plain(dt)(5, 100), 7), {})]


def topk_check(x, ours, ref, tol):
    # indices of equal values may legally differ from torch's; the values and x[idx] may not
    (values, idx), (ref_values, _) = ours, ref
    ok = torch.equal(values, ref_values) and torch.equal(x.gather(-1, idx), values)
    return ok, "ok exact" if ok else "FAIL"


@bench_rows("ops")
def bench_topk(rows):
    for shape, k in (((4096, 8), 2), ((1, 50304), 50), ((64, 50304), 50), ((1, 262144), 128)):
        x = rand(*shape)
        bench_op(rows, "topk", f"{shape[0]}x{shape[1]} k={k}", "fwd", lambda ops, x: ops.topk(x, k), [x],
                 4 * x.numel(), "GB/s", check_fn=functools.partial(topk_check, x))


# ==== op: matmul, linear ====
# matmul and linear against their float64 twins, forward and backward: fp32 (mma.sync, wgmma, split K), bf16
# on Hopper, linear's fp32 master weights, inf and NaN; their bad inputs, opcheck arguments, stress, bench.


def t_matmul(M, K, N, batch=None, a_t=False, b_step=1):
    lead = (batch,) if batch else ()
    a = rand(*lead, K, M).transpose(-1, -2) if a_t else rand(*lead, M, K)
    b = rand(*lead, K, N * b_step)[..., ::b_step]
    compare(lambda ops, a, b: ops.matmul(a, b), mm_tol(M, K, N), mm_tol(M, K, N), a=a, b=b)


def t_linear(lead, K, N, bias=True, transposed=False):
    # transposed: x and weight arrive as transposed views, as after a head split or with a tied weight
    x = rand(*lead[::-1], K).transpose(0, 1) if transposed else rand(*lead, K)
    w = rand(K, N).t() if transposed else rand(N, K)
    tol = mm_tol(math.prod(lead), K, N)
    if bias:
        compare(lambda ops, x, w, b: ops.linear(x, w, b), tol, tol, x=x, w=w, b=rand(N))
    else:
        compare(lambda ops, x, w: ops.linear(x, w), tol, tol, x=x, w=w)


for _dims in ((1, 1, 1), (17, 33, 65), (127, 1, 255), (129, 65, 17), (64, 128, 16), (255, 257, 127),
              (1000, 1100, 700)):
    add("matmul/" + "x".join(map(str, _dims)), t_matmul, *_dims)
add("matmul/3x17x33x65", t_matmul, 17, 33, 65, batch=3)
add("matmul/2x128x64x200", t_matmul, 128, 64, 200, batch=2)
add("matmul/33x65x17_aT_bstep2", t_matmul, 33, 65, 17, a_t=True, b_step=2)
add("matmul/100x300x130_aT", t_matmul, 100, 300, 130, a_t=True)
add("matmul/3x17x33x65_aT_bstep2", t_matmul, 17, 33, 65, batch=3, a_t=True, b_step=2)
# few output tiles and a long K: the kernel splits K and adds the partial products
add("matmul/33x5000x65_splitK", t_matmul, 33, 5000, 65)
add("matmul/3x40x2001x50_splitK_aT", t_matmul, 40, 2001, 50, batch=3, a_t=True)
# On Hopper, products of 512^3 and up with every dim >= 128 take the pack + wgmma kernel: ragged
# edges in every dim, transposes, a batch, a strided operand, split K, and a misaligned pointer
add("matmul/257x515x1031_wgmma", t_matmul, 257, 515, 1031)
add("matmul/2x300x700x333_wgmma_aT_bstep2", t_matmul, 300, 700, 333, batch=2, a_t=True, b_step=2)
add("matmul/130x8200x129_wgmma_splitK", t_matmul, 130, 8200, 129)
add("matmul/200x700x1000_wgmma_misaligned", lambda: compare(lambda ops, a, b: ops.matmul(a, b), mm_tol(200, 700, 1000),
    mm_tol(200, 700, 1000), a=misaligned(200, 700), b=misaligned(700, 1000)))


def t_matmul_tall(M, K, N):
    # Hopper's pack pass runs over 128-row tiles on grid.y, which stops at 65535 (8.4M rows): M = 65537 * 128
    # + 1 rows are packed in two launches, of 65535 tiles and of 3, the last of one row (one launch of them
    # all failed; elsewhere the mma.sync kernel runs, rows on grid.x). Checked in slices of rows, so the
    # float64 reference stays small.
    past_grid_limit()
    a, b = rand(M, K), rand(K, N)
    c = kernels.matmul(a, b)
    for r0 in range(0, M, 1 << 20):
        check(f"rows_{r0}", c[r0:r0 + (1 << 20)], a[r0:r0 + (1 << 20)].double() @ b.double(), mm_tol(K))
    return f"{(M + (1 << 20) - 1) >> 20} slices of rows"


add("matmul/8388737x128x128_pack_rows_past_grid_y", t_matmul_tall, 8388737, 128, 128)


def t_matmul_special(M, K, N, batch=None, a_t=False, linear=False, bias=False):
    # +-inf and NaN operands give what an fp32 product gives: +-inf where infinite terms of one sign meet
    # finite ones, NaN for inf * 0, inf - inf or a NaN term (3xTF32 alone gives NaN wherever an inf reaches).
    # Rows 0-3 put them at the start of K, rows 4-6 in its middle and at its end (split K's later splits;
    # row 6's inf and -inf in different splits of a long K), and row 5's NaN at k = 0 sits right after row
    # 4's last element in a row-major a: a sum that read past K would turn row 4's inf into NaN.
    lead = (batch,) if batch else ()
    a = rand(*lead, K, M).transpose(-1, -2) if a_t else rand(*lead, M, K)
    b = rand(*lead, K, N)
    inf, nan = float("inf"), float("nan")
    a[..., 0, 1], a[..., 1, 2], a[..., 2, 1], a[..., 2, 2], a[..., 3, 4] = inf, -inf, inf, inf, nan
    a[..., 4, K - 1], a[..., 5, 0], a[..., 5, K // 2], a[..., 6, 1], a[..., 6, K - 1] = inf, nan, -inf, inf, -inf
    b[..., 5, 0], b[..., 1, 3] = -inf, 0.0  # column 0 meets an inf in every row; rows 0, 2 and 6 meet a zero
    bias_t = rand(N) if bias else None
    ours = (kernels.linear(a, b.transpose(-1, -2), bias_t) if linear else kernels.matmul(a, b)).double().cpu()
    ref = a.double().cpu() @ b.double().cpu() + (bias_t.double().cpu() if bias else 0.0)
    check_nonfinite("out", ours, ref, mm_tol(M, K, N))
    return f"{int(ref.isnan().sum())} NaN, {int(ref.isposinf().sum())} +inf, {int(ref.isneginf().sum())} -inf as fp32's"


add("matmul_special/17x33x65", t_matmul_special, 17, 33, 65)
add("matmul_special/3x17x33x65_aT", t_matmul_special, 17, 33, 65, batch=3, a_t=True)
add("matmul_special/33x5000x65_splitK", t_matmul_special, 33, 5000, 65)
add("matmul_special/linear_40x64x24_bias", t_matmul_special, 40, 64, 24, linear=True, bias=True)
add("matmul_special/257x515x1031_wgmma", t_matmul_special, 257, 515, 1031)
add("matmul_special/2x300x700x333_wgmma_aT", t_matmul_special, 300, 700, 333, batch=2, a_t=True)
add("matmul_special/130x8200x129_wgmma_splitK", t_matmul_special, 130, 8200, 129)
# linear's weight is B transposed; 144 output tiles fill an H100 (132 SMs), so K is not split and the
# bias is added in the wgmma epilogue itself
add("matmul_special/linear_2048x192x1152_wgmma_bias", t_matmul_special, 2048, 192, 1152, linear=True, bias=True)
add("matmul_special/linear_600x700x500_wgmma_splitK", t_matmul_special, 600, 700, 500, linear=True)


def t_matmul_bf16(M, K, N, batch=None, a_t=False, b_t=False):
    lead = (batch,) if batch else ()
    a = rand(*lead, K, M).transpose(-1, -2) if a_t else rand(*lead, M, K)
    b = rand(*lead, N, K).transpose(-1, -2) if b_t else rand(*lead, K, N)
    # the backward's products are K-long over M (db) and N (da): the longest sets the tolerance
    compare_bf16(lambda ops, a, b: ops.matmul(a, b), max(M, K, N), a=a, b=b)


def t_linear_bf16(lead, K, N, bias=True):
    x, w = rand(*lead, K), rand(N, K)
    if bias:
        compare_bf16(lambda ops, x, w, b: ops.linear(x, w, b), max(math.prod(lead), K, N), x=x, w=w, b=rand(N))
    else:
        compare_bf16(lambda ops, x, w: ops.linear(x, w), max(math.prod(lead), K, N), x=x, w=w)


# Tiles are 128 x BN x 64, BN 256 or 192 by the rounds of tiles over the SMs, 128 or 64 where even those
# fill under half the SMs and K is too short to split (most of the small cases here: 64, with 8 stages;
# 1000x200x1536: 128, with 6): sizes of 1, odd sizes (rows that are not 16-byte multiples get padded
# copies), exact tiles, many K tiles, every operand orientation, a batch. Outputs whose rows are 16-byte
# multiples (N = 200, 256, 264, 2600, 3072, ...) are stored through the copy engine, the others from
# registers.
for _dims in ((1, 1, 1), (17, 33, 65), (128, 64, 256), (257, 515, 1031), (300, 2048, 200)):
    add("matmul_bf16/" + "x".join(map(str, _dims)), t_matmul_bf16, *_dims)
add("matmul_bf16/3x129x72x264_aT", t_matmul_bf16, 129, 72, 264, batch=3, a_t=True)
add("matmul_bf16/2x200x136x300_bT", t_matmul_bf16, 200, 136, 300, batch=2, b_t=True)
add("matmul_bf16/130x520x260_aT_bT", t_matmul_bf16, 130, 520, 260, a_t=True, b_t=True)
add("matmul_bf16/1000x200x1536_aT", t_matmul_bf16, 1000, 200, 1536, a_t=True)
# more tiles than SMs: each persistent block walks several tiles (and batch entries), its stage ring
# (4 stages, 5 K steps a tile) wrapping in the middle of a tile
add("matmul_bf16/3x1100x300x2600", t_matmul_bf16, 1100, 300, 2600, batch=3)
# 256-wide tiles (2 rounds against 3 at 192) over 13 K tiles, 184 of them: the blocks with a second tile store
# their first while the second's first products run, across the batch entries; the last row and column of
# tiles clipped (2900 and 1000)
add("matmul_bf16/2x2900x800x1000", t_matmul_bf16, 2900, 800, 1000, batch=2)
# split-K (few tiles, long K): 8 splits of 2 tiles, the lower one 2 rows tall, the last split shorter
# (2 of 65 K tiles); a batch of M-major A split 5 ways (300x2048x200 above splits 4 ways)
add("matmul_bf16/130x4100x72", t_matmul_bf16, 130, 4100, 72)
add("matmul_bf16/2x77x3000x260_aT", t_matmul_bf16, 77, 3000, 260, batch=2, a_t=True)
# (4, 2000) rows: the weight gradient is 200 x 96 over K = 8000, split along K
# (2, 300) x 384 -> 1152: the large preset's qkv width, six 192-wide tiles, its bias gradient 4 columns a thread.
# (8, 1024) rows: 768 and 384 output tiles, several per persistent block, so each block restages the
# bias between tiles, through the copy-engine store (N = 3072) and from registers (N = 1031).
# The bias gradient comes from the weight gradient's product dy^T x (A's row sums over the tokens):
# (2, 1500) x 520 -> 130 has two tile rows (the lower one 2 rows tall) and three tile columns, of which
# only the first adds, over 5 splits of 3000 tokens; (2, 200) x 1100 -> 4200, 198 tiles unsplit, has
# each block walk several tiles (its stage ring wrapping inside one, its row sums restarting); one
# token, no tokens, and one output (M = 1, A copied into padded rows). in_features = 0 has no product
# and sums the columns on their own. (4, 1425) x 800 -> 1000: 180 tiles 256 wide, 48 blocks with two, which
# store the first, with its bias, while the second's first products run.
for _lead, _K, _N, _bias in (((2, 7), 33, 65, True), ((3, 100), 768, 3072, True), ((4, 1000), 64, 96, False),
                             ((4, 2000), 96, 200, True), ((2, 300), 384, 1152, True), ((8, 1024), 256, 3072, True),
                             ((8, 1024), 256, 1031, True), ((2, 1500), 520, 130, True), ((2, 200), 1100, 4200, True),
                             ((1,), 40, 3, True), ((0,), 32, 64, True), ((3, 7), 24, 1, True),
                             ((3, 5), 0, 64, True),  # in_features = 0: out = bias
                             ((4, 1425), 800, 1000, True)):
    add(f"linear_bf16/{'x'.join(map(str, _lead))}x{_K}_to_{_N}" + "_bias" * _bias, t_linear_bf16, _lead, _K, _N,
        bias=_bias)


def t_linear_bf16_one_output_strided_dy():
    # one output feature and a dy whose size-1 dim has a stride other than 1 (as a transpose downstream
    # leaves it): the stride of a size-1 dim means nothing, and the bias gradient's row sums must not ask it
    dy = torch.randn(3, 1, 7, device=DEV).to(BF16).transpose(1, 2)
    compare_bf16(lambda ops, x, w, b: ops.linear(x, w, b), 21, dy=dy, x=rand(3, 7, 24), w=rand(1, 24), b=rand(1))


add("linear_bf16/3x7x24_to_1_bias_strided_dy", t_linear_bf16_one_output_strided_dy)


def t_linear_master(lead, K, N, bias=True, grad=True):
    # mixed precision's linear: a bf16 x with the fp32 master weight and bias, against autocast's F.linear
    # (weight and bias cast to bf16). The weight and bias hold bf16 values, so the float64 reference
    # multiplies what our kernel does; their gradients must come back in fp32. grad=False with one row:
    # the GEMV path, which rounds the weight first.
    if grad and torch.cuda.get_device_capability() != (9, 0):
        raise Skip("bf16 matmul runs on Hopper's wgmma (compute capability 9.0)")
    x, w, b = rand(*lead, K).to(BF16), rand(N, K).to(BF16).float(), rand(N).to(BF16).float()
    tol = bf16_tol(max(math.prod(lead), K, N))
    grad_tol = tol if grad else None
    if bias:
        compare_dtypes(lambda x, w, b: kernels.linear(x, w, b), lambda x, w, b: F.linear(x, w.to(x.dtype), b.to(
            x.dtype)), tol, grad_tol, x=x, w=w, b=b)
    else:
        compare_dtypes(lambda x, w: kernels.linear(x, w), lambda x, w: F.linear(x, w.to(x.dtype)), tol, grad_tol,
                       x=x, w=w)


# odd sizes (padded copies of the rounded weight), the weight gradient split along K (fp32 through the
# split-K sum), the large preset's qkv width, no bias, K = 0 (out = bias), one row through the GEMV
for _lead, _K, _N, _bias, _grad in (((2, 7), 33, 65, True, True), ((4, 2000), 96, 200, True, True),
                                    ((2, 1500), 520, 130, True, True),
                                    ((2, 300), 384, 1152, True, True), ((3, 100), 768, 3072, False, True),
                                    ((3, 5), 0, 64, True, True), ((1,), 768, 3072, True, False)):
    add(f"linear_bf16_master/{'x'.join(map(str, _lead))}x{_K}_to_{_N}" + "_bias" * _bias + "_gemv" * (not _grad),
        t_linear_master, _lead, _K, _N, bias=_bias, grad=_grad)


for _lead, _K, _N, _bias, _tr in (((1,), 1, 1, True, False), ((2, 7), 33, 65, True, False),
                                  ((2, 7), 33, 65, False, False), ((3, 100), 768, 3072, True, False),
                                  ((5,), 1000, 17, False, False), ((2, 7), 33, 65, True, True),
                                  ((4, 1000), 64, 96, True, False),  # weight grad splits K = 4000
                                  ((3, 5), 0, 64, True, False)):  # in_features = 0: out = bias, like F.linear
    add(f"linear/{'x'.join(map(str, _lead))}x{_K}_to_{_N}" + "_bias" * _bias + "_transposed" * _tr,
        t_linear, _lead, _K, _N, bias=_bias, transposed=_tr)


# Empty inputs (an expert that receives no tokens, an empty batch): empty outputs and zero gradients.
add("empty/linear_0x300_to_64_bias", t_linear, (0,), 300, 64)
add("empty/matmul_0x256x64", t_matmul, 0, 256, 64)


def t_stress_linear(lead, K, N, dtype):
    # few output tiles, many tokens: the weight gradient's K (the tokens) is split, the splits summed after
    if dtype == BF16 and torch.cuda.get_device_capability() != (9, 0):
        raise Skip("bf16 matmul runs on Hopper's wgmma (compute capability 9.0)")
    x, w, b = (rand(*shape).to(dtype).requires_grad_() for shape in ((*lead, K), (N, K), (N,)))
    return stress(lambda: grads(kernels.linear(x, w, b), [x, w, b]))


for _dt, _tag in ((torch.float32, "fp32"), (BF16, "bf16")):
    add(f"stress/linear_4x2000x96_to_200_{_tag}", t_stress_linear, (4, 2000), 96, 200, _dt)


bad_inputs(
    ("linear_cpu_weight", RuntimeError, lambda: kernels.linear(rand(4, 8), torch.randn(5, 8)), ("linear", "weight")),
    ("matmul_float64_b", RuntimeError, lambda: kernels.matmul(rand(4, 8), rand(8, 5).double()), ("matmul", "b")),
    ("linear_K_mismatch", RuntimeError, lambda: kernels.linear(rand(4, 8), rand(5, 9)), ("linear", ("x", "weight"))),
    ("matmul_inner_dim", RuntimeError, lambda: kernels.matmul(rand(4, 8), rand(9, 5)), ("matmul", ("a", "b"))),
    ("matmul_bf16_with_float32", RuntimeError, lambda: kernels.matmul(rand(4, 8).bfloat16(), rand(8, 5)),
     ("matmul", "b", "BFloat16")),
    ("linear_bf16_float32_bias", RuntimeError,
     lambda: kernels.linear(rand(4, 8).bfloat16(), rand(5, 8).bfloat16(), rand(5)), ("linear", "bias", "BFloat16")),
    ("linear_float32_x_bf16_weight", RuntimeError, lambda: kernels.linear(rand(4, 8), rand(5, 8).bfloat16()),
     ("linear", "weight", "Float")),  # the fp32 master weight goes with a bf16 x, not the other way round
    ("linear_master_weight_bf16_bias", RuntimeError,
     lambda: kernels.linear(rand(4, 8).bfloat16(), rand(5, 8), rand(5).bfloat16()), ("linear", "bias", "Float")),
    ("matmul_float16_a", RuntimeError, lambda: kernels.matmul(rand(4, 8).half(), rand(8, 5).half()),
     ("matmul", "a", "bfloat16")),
    # shapes: a 3-D matmul's batches
    ("matmul_3d_batch_mismatch", RuntimeError, lambda: kernels.matmul(rand(2, 4, 8), rand(3, 8, 5)),
     ("matmul", "a", "b", "batch")),
)


@opcheck_args
def opcheck_matmul_linear(dt):
    plain, k = _plain(dt), torch.ops.kernels
    x2, w2, b2 = _leaf(5, 7, 37, dtype=dt), _leaf(19, 37, dtype=dt), _leaf(19, dtype=dt)
    cases = [("linear", k.linear, (x2, w2, b2), {}), ("linear_no_bias", k.linear, (x2, w2, None), {}),
             ("linear_backward", k.linear_backward, (plain(5, 7, 19), plain(5, 7, 37), plain(19, 37), True), {}),
             ("matmul", k.matmul, (_leaf(33, 17, dtype=dt), _leaf(17, 9, dtype=dt)), {}),
             ("matmul_batched", k.matmul, (_leaf(2, 33, 17, dtype=dt), _leaf(2, 17, 9, dtype=dt)), {}),
             ("matmul_backward", k.matmul_backward, (plain(2, 33, 9), plain(2, 33, 17), plain(2, 17, 9)), {})]
    if dt == BF16:  # mixed precision: a bf16 x with the fp32 master weight and bias
        cases.append(("linear_master_weight", k.linear, (x2, _leaf(19, 37), _leaf(19)), {}))
    return cases


@bench_rows("ops")
def bench_matmul_linear(rows):
    for n in (1024, 4096):
        bench_op(rows, "matmul", f"{n}x{n}x{n}", "fwd", lambda ops, a, b: ops.matmul(a, b),
                 [rand(n, n), rand(n, n)], 2 * n**3, "TFLOP/s")
    if torch.cuda.get_device_capability() == (9, 0):  # bf16 against cuBLAS's bf16 (fp32 accumulation)
        bf = torch.bfloat16
        for n in (1024, 4096, 8192):
            bench_op(rows, "matmul bf16", f"{n}x{n}x{n}", "fwd", lambda ops, a, b: ops.matmul(a, b),
                     [rand(n, n).to(bf), rand(n, n).to(bf)], 2 * n**3, "TFLOP/s", tol=2e-2)
        n = 4096
        bench_op(rows, "matmul bf16", f"{n}x{n}x{n} a@b.T", "fwd", lambda ops, a, b: ops.matmul(a, b.t()),
                 [rand(n, n).to(bf), rand(n, n).to(bf)], 2 * n**3, "TFLOP/s", tol=2e-2)
        # 768 -> 3072: an MLP up-projection of width 768; the char GPT's large preset (width 384, 16384
        # tokens a step): qkv, attention out, MLP up and down; its --arch=llama (no biases): qkv with 3 of
        # 6 heads for keys and values, SwiGLU's fc and up, its proj; the default preset (width 128, 1024
        # tokens). bwd: dx (N-major B) and dW (M-major A, K = the tokens: few output tiles, split along K).
        shapes = [(16384, 768, 3072, True), (16384, 384, 1152, True), (16384, 384, 384, True),
                  (16384, 384, 1536, True), (16384, 1536, 384, True), (16384, 384, 768, False),
                  (16384, 384, 1024, False), (16384, 1024, 384, False), (1024, 128, 384, True),
                  (1024, 128, 128, True), (1024, 128, 512, True), (1024, 512, 128, True)]
        for M, K, N, bias in shapes:
            ins = [rand(M, K).to(bf), rand(N, K).to(bf)] + ([rand(N).to(bf)] if bias else [])
            name = f"{M}x{K}->{N}" + ("" if bias else " no bias")
            for pas, flop in (("fwd", 2 * M * K * N), ("bwd", 4 * M * K * N)):
                bench_op(rows, "linear bf16", name, pas, lambda ops, *xwb: ops.linear(*xwb), ins, flop, "TFLOP/s",
                         tol=2e-2)


# ==== op: attention ====
# attention against SDPA in float64: tiled, fused fp32 and tf32, fused bf16 (mma.sync and Hopper's wgmma),
# GQA, kv_len, misaligned, long; its bad inputs, opcheck arguments, stress and its three bench tables.


def ref_attention(q, k, v, mode=None, precision=None, **kw):
    """SDPA as the torch op set calls it; mode and precision choose among our kernels only."""
    return train.torch_attention(q, k, v, **kw)


REF.attention = ref_attention


ATTN_IMPLS = {"fused-fp32": dict(mode="fused", precision="fp32"),
              "fused-tf32": dict(mode="fused", precision="tf32"),
              "tiled": dict(mode="tiled")}
# (out, grads) for unit-scale inputs; tf32 keeps 10 mantissa bits of q, k, P and v
ATTN_TOL = {"fused-fp32": (1e-4, 2e-4), "tiled": (1e-4, 2e-4), "fused-tf32": (5e-3, 1e-2)}


def packed_qkv(B, S, H, Hkv, D, dtype=torch.float32):
    """q, k, v as the model's attention makes them: head views (B, H, S, D) of one (B, S, (H + 2 Hkv) D)
    projection, rows (H + 2 Hkv) D apart."""
    parts = rand(B, S, (H + 2 * Hkv) * D).to(dtype).split([H * D, Hkv * D, Hkv * D], dim=2)
    return [t.view(B, S, -1, D).transpose(1, 2) for t in parts]


def attention_recording_layout(impl, seen, ours_kw=None, **kw):
    """ops.attention(q, k, v, **kw) that notes, for our fused op, whether out came back in (B, S, H, D)
    memory (the heads side by side, which the next projection reads without a copy). ours_kw: more
    arguments for our op alone."""
    def f(ops, q, k, v):
        ours = (ours_kw or {}) if ops is kernels else {}
        out = ops.attention(q, k, v, **kw, **ATTN_IMPLS.get(impl, {}), **ours)
        if ops is kernels:
            seen["out_bshd"] = out.transpose(1, 2).is_contiguous()
        return out
    return f


def t_attention(impl, B, H, Sq, Sk, D, causal, mag=1, scale=None, bshd=False, kv_heads=None, packed=False):
    def qkv(S, heads, m=1):
        # bshd: (B, S, H, D) memory seen through a transpose, as a fused qkv projection leaves it
        return rand(B, S, heads, D, scale=m).transpose(1, 2) if bshd else rand(B, heads, S, D, scale=m)
    Hkv = kv_heads or H  # fewer: grouped-query attention
    tol, g = ATTN_TOL[impl]
    # q scaled by m: score rounding grows m-fold, and dk = dS^T q is m times larger on top of that;
    # a shared K/V head's gradient sums H / Hkv heads' terms, its rounding error ~sqrt of that
    group = math.sqrt(H // Hkv)
    grad_tol = dict(q=g * mag, k=g * mag * mag * group, v=g * mag * group)
    # packed: q, k, v views of one projection (Sq == Sk), read in place by the fused kernels
    q, k, v = packed_qkv(B, Sq, H, Hkv, D) if packed else (qkv(Sq, H, mag), qkv(Sk, Hkv), qkv(Sk, Hkv))
    # packed: dout in (B, S, H, D) memory too, as the gradient of the model's heads side by side
    dy = rand(B, Sq, H, D).transpose(1, 2) if packed else None
    seen = {}
    compare(attention_recording_layout(impl, seen, causal=causal, scale=scale), tol * mag, grad_tol, dy=dy,
            q=q, k=k, v=v)
    if impl != "tiled":
        assert seen["out_bshd"], "the fused op's out is not in (B, S, H, D) memory"


_C = True  # causal
ATTN_CASES = [  # impl, B, H, Sq, Sk, D, causal, extras
    ("fused-fp32", 1, 1, 1, 1, 64, False, {}),
    ("fused-fp32", 2, 3, 1, 1, 32, _C, {}),
    ("fused-fp32", 2, 3, 17, 17, 32, False, {}),
    ("fused-fp32", 2, 3, 17, 17, 64, _C, {}),
    ("fused-fp32", 2, 3, 17, 17, 128, _C, {}),
    ("fused-fp32", 2, 3, 17, 17, 96, _C, {}),
    ("fused-fp32", 2, 3, 1000, 1000, 96, _C, {}),
    ("fused-fp32", 1, 8, 1, 256, 96, _C, {}),
    ("fused-fp32", 2, 3, 64, 64, 64, False, {}),
    ("fused-fp32", 2, 3, 64, 64, 128, _C, {}),
    ("fused-fp32", 2, 3, 1000, 1000, 32, False, {}),
    ("fused-fp32", 2, 3, 1000, 1000, 64, _C, {}),
    ("fused-fp32", 2, 3, 1000, 1000, 128, False, {}),
    ("fused-fp32", 2, 3, 2048, 2048, 64, _C, {}),
    ("fused-fp32", 1, 2, 2048, 2048, 128, False, {}),
    ("fused-fp32", 2, 3, 1, 17, 128, False, {}),
    ("fused-fp32", 2, 3, 1, 1000, 64, _C, {}),
    ("fused-fp32", 2, 3, 17, 64, 64, _C, {}),
    ("fused-fp32", 2, 3, 64, 1000, 32, _C, {}),
    ("fused-fp32", 2, 3, 17, 2048, 128, _C, {}),
    ("fused-fp32", 2, 3, 64, 2048, 64, False, {}),
    ("fused-fp32", 2, 3, 1000, 1000, 64, _C, dict(mag=30)),
    ("fused-fp32", 2, 3, 64, 64, 128, False, dict(mag=30)),
    ("fused-fp32", 2, 3, 1, 2048, 64, _C, dict(mag=30)),
    ("fused-fp32", 2, 3, 64, 64, 64, False, dict(scale=0.3)),
    # the forward's row max runs over raw scores: a negative scale runs as -q, a zero one gives uniform weights
    ("fused-fp32", 2, 3, 100, 100, 64, _C, dict(scale=-0.3)),
    ("fused-fp32", 2, 3, 17, 70, 64, _C, dict(scale=0.0)),
    ("fused-fp32", 2, 3, 1000, 1000, 64, _C, dict(bshd=True)),
    ("fused-fp32", 2, 3, 1000, 1000, 64, _C, dict(packed=True)),
    ("fused-tf32", 2, 6, 256, 256, 64, _C, dict(packed=True)),
    ("tiled", 1, 1, 1, 1, 64, False, {}),
    ("tiled", 2, 3, 17, 17, 32, _C, dict(scale=0.3)),
    ("tiled", 2, 3, 17, 17, 48, False, {}),
    ("tiled", 2, 3, 64, 64, 128, False, {}),
    ("tiled", 2, 3, 1000, 1000, 64, _C, {}),
    ("tiled", 2, 3, 2048, 2048, 64, False, {}),
    ("tiled", 2, 3, 1, 64, 64, _C, {}),
    ("tiled", 2, 3, 17, 1000, 128, _C, {}),
    ("tiled", 2, 3, 1000, 1000, 64, False, dict(mag=30)),
    ("tiled", 2, 3, 17, 64, 32, _C, dict(mag=30)),
    ("tiled", 2, 3, 64, 64, 64, _C, dict(bshd=True)),
    ("fused-tf32", 2, 3, 17, 17, 128, False, {}),
    ("fused-tf32", 2, 3, 64, 64, 64, False, {}),
    ("fused-tf32", 2, 3, 1000, 1000, 64, _C, {}),
    ("fused-tf32", 2, 3, 2048, 2048, 128, _C, {}),
    ("fused-tf32", 2, 3, 1, 1000, 32, _C, {}),
    # grouped-query attention: H query heads over kv_heads K/V heads (1: multi-query)
    ("fused-fp32", 2, 8, 17, 17, 64, _C, dict(kv_heads=2)),
    ("fused-fp32", 2, 8, 1000, 1000, 64, _C, dict(kv_heads=2)),
    ("fused-fp32", 1, 8, 2048, 2048, 128, False, dict(kv_heads=1)),
    ("fused-fp32", 2, 6, 1, 1000, 96, _C, dict(kv_heads=3)),
    ("fused-fp32", 2, 4, 64, 300, 32, _C, dict(kv_heads=2)),
    ("fused-fp32", 1, 8, 129, 129, 64, _C, dict(kv_heads=2, bshd=True)),
    ("fused-fp32", 1, 8, 129, 129, 128, _C, dict(kv_heads=2, packed=True)),
    ("fused-fp32", 2, 8, 1000, 1000, 64, _C, dict(kv_heads=4, mag=30)),
    ("fused-tf32", 2, 8, 1000, 1000, 64, _C, dict(kv_heads=2)),
    ("tiled", 2, 8, 17, 17, 48, _C, dict(kv_heads=2)),
    ("tiled", 2, 6, 1, 64, 64, _C, dict(kv_heads=3)),
    ("tiled", 2, 8, 1000, 1000, 64, False, dict(kv_heads=1)),
    ("tiled", 2, 4, 64, 64, 64, _C, dict(kv_heads=2, bshd=True)),
]
for _impl, _B, _H, _Sq, _Sk, _D, _causal, _extra in ATTN_CASES:
    _name = f"attention/{_impl}/b{_B}h{_H}_q{_Sq}k{_Sk}_d{_D}" + "_causal" * _causal
    _name += "".join(f"_{key}" if val is True else f"_{key}{val}" for key, val in _extra.items())
    add(_name, t_attention, _impl, _B, _H, _Sq, _Sk, _D, _causal, **_extra)


def t_attention_long(dtype, H, Hkv, Sq, Sk, D, causal, rel):
    """Attention past the 65535 blocks a grid.y takes: the mma.sync kernels' forward has a block for every 64
    query rows of a K/V head (128 in bf16 at D <= 64), their backward one for every 64 keys and every 64
    queries of a head, and both fold these blocks with the heads into grid.x (a grid.y of them failed:
    invalid configuration argument). Outputs and gradients that sum millions of terms are far from unit
    scale, so each is held to rel[name] of its own largest magnitude; a block that misses or misplaces its
    rows is off by all of it. The fp32 gradients that sum over millions of rows or keys drift in our
    kernels: on an H200, dk and dv over 2.1M query rows of two heads 2.5e-2 and 3.8e-2 of their largest
    entry, dq over 4.2M keys 3.0e-2, where PyTorch's fp32 SDPA stays under 2e-5: held to 8e-2 here, a limit
    of the mma.sync backward's accumulation over long sequences that these cases state, not hide."""
    past_grid_limit()
    q, k, v, dy = rand(1, H, Sq, D), rand(1, Hkv, Sk, D), rand(1, Hkv, Sk, D), rand(1, H, Sq, D)
    ours_in = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = kernels.attention(*ours_in, causal=causal)
    ours = (out, *torch.autograd.grad(out, ours_in, dy.to(dtype)))
    ref_in = [t.detach().double().requires_grad_() for t in ours_in]
    ref = REF.attention(*ref_in, causal=causal)
    refs = (ref, *torch.autograd.grad(ref, ref_in, dy.to(dtype).double()))
    for label, a, r in zip(("out", "dq", "dk", "dv"), ours, refs, strict=True):
        check(label, a, r, rel.get(label, rel["default"]) * r.abs().max().item())


# fp32, 2 query heads a K/V head: 4.2M rows of whole 64-row tiles (the forward's heaviest-first order over
# the group); 4.2M keys, causal, in the backward; bf16 at D = 32 (mma.sync, 128 rows a forward block): 8.4M
# rows of a ragged last tile forward, 4.2M queries backward
for _dt, _H, _Hkv, _Sq, _Sk, _D, _causal, _rel in (
        (torch.float32, 2, 1, 2097152, 96, 32, False, dict(default=1e-3, dk=8e-2, dv=8e-2)),
        (torch.float32, 2, 1, 65, 4194305, 32, True, dict(default=1e-3, dq=8e-2)),
        (BF16, 2, 1, 4194305, 64, 32, False, dict(default=2e-2))):
    add(f"attention/fused-{'bf16' if _dt == BF16 else 'fp32'}/long_h{_H}kv{_Hkv}_q{_Sq}k{_Sk}_d{_D}"
        + "_causal" * _causal + "_past_grid_y", t_attention_long, _dt, _H, _Hkv, _Sq, _Sk, _D, _causal, _rel)


def t_attention_misaligned(impl):
    # q, k, v and dout each start 4 bytes into an allocation: the fused kernels' 16-byte copies
    # (cp.async) must not see that, nor may the tiled path's matmuls. `seen` holds each one's address
    # mod 16 as our op received it (dout: as autograd hands it to the attention's backward).
    B, H, S, D = 2, 3, 17, 64
    seen = {}

    def f(ops, q, k, v):
        out = ops.attention(q, k, v, **ATTN_IMPLS[impl])
        if ops is kernels:
            seen.update({n: t.data_ptr() % 16 for n, t in (("q", q), ("k", k), ("v", v))})
            out.register_hook(lambda g: seen.update(dout=g.data_ptr() % 16))
        return out

    tol, g = ATTN_TOL[impl]
    compare(f, tol, g, dy=misaligned(B, H, S, D), q=misaligned(B, H, S, D), k=misaligned(B, H, S, D),
            v=misaligned(B, H, S, D))
    assert sorted(seen) == ["dout", "k", "q", "v"] and all(seen.values()), f"address mod 16 seen by the op: {seen}"
    return "q, k, v, dout at address mod 16 = " + ", ".join(str(seen[n]) for n in ("q", "k", "v", "dout"))


for _impl in ("fused-fp32", "tiled"):
    add(f"attention/{_impl}/misaligned_qkv_dout", t_attention_misaligned, _impl)


def t_attention_joined_split():
    """The model's path on the cuda op set: q, k, v split from one projection x by train.joined_split; the
    fused backward writes dq, dk, dv side by side in one buffer, which the split's backward hands back as
    x's gradient without a copy. x's gradient against float64 split + attention."""
    B, S, H, Hkv, D = 2, 100, 4, 2, 64
    joined, join = [], train.join_last

    def recording(parts):
        out = join(parts)
        joined.append(out.data_ptr() == parts[0].data_ptr())
        return out

    def f(ops, x):
        split = ops.split if ops is REF else train.joined_split
        q, k, v = (t.view(B, S, -1, D).transpose(1, 2) for t in split(x, [H * D, Hkv * D, Hkv * D]))
        return ops.attention(q, k, v, causal=True)
    with unittest.mock.patch.object(train, "join_last", recording):
        tol, g = ATTN_TOL["fused-fp32"]
        compare(f, tol, g * math.sqrt(H // Hkv), x=rand(B, S, (H + 2 * Hkv) * D))
    assert joined == [True], f"the split's backward copied: {joined}"
    return "dq, dk, dv joined in place"


add("attention/fused-fp32/joined_split", t_attention_joined_split)


def t_attention_dropout(dtype, B, H, Sq, Sk, D, causal, p=0.2, kv_heads=None, packed=False, wgmma=True):
    """Dropout on the probabilities inside the fused kernels, against the twin's spelled-out attention with the
    same masks (train.torch_attention: rows (b * H + h) * Sq + i of Sk columns), forward and backward: a
    kernel that skipped the dropout, or drew another mask, is off by whole probabilities. The outputs grow by
    1 / (1 - p), and so do the tolerances. bf16 on Hopper at head sizes 64 and 128 runs the Hopper kernels
    (wgmma=False: mma.sync), checked from the kernels' names."""
    Hkv = kv_heads or H
    rng, salt = dropout_rng(seed=4321, offset=77), 5
    grow = 1 / (1 - p)
    hopper = dtype == BF16 and D in (64, 128) and torch.cuda.get_device_capability() == (9, 0)
    if not wgmma and not hopper:
        raise Skip("wgmma=False differs from the default only for bf16 at head sizes 64, 128 on compute capability 9.0")

    def f(ops, q, k, v):
        return ops.attention(q, k, v, causal=causal, dropout_p=p, rng=rng, salt=salt)
    if packed:
        q, k, v = packed_qkv(B, Sq, H, Hkv, D)
    else:
        q, k, v = rand(B, H, Sq, D), rand(B, Hkv, Sk, D), rand(B, Hkv, Sk, D)
    if dtype == torch.float32:
        tol, g = ATTN_TOL["fused-fp32"]
        group = math.sqrt(H // Hkv)
        compare(f, tol * grow, dict(q=g * grow, k=g * grow * group, v=g * grow * group), q=q, k=k, v=v)
        route = ""
    else:
        tol = {n: (a * grow, r) for n, (a, r) in attn_bf16_tol(1, H // Hkv).items()}
        # The kernels round P z (z: 0 or 1 / (1 - p)) to bf16 before P V; the float64 twin keeps it. In a row of
        # few keys (causal's first rows) those roundings, 2^-9 of each term at most, add up to 2^-9 grow max|v|
        # where the terms cancel to a small output, past the atol (4x8x1024: 5.2e-3 at 0.036).
        bound = 2**-9 * grow * v.bfloat16().abs().max().item()
        tol["out"] = (max(tol["out"][0], bound), tol["out"][1])
        with attention_wgmma(wgmma):
            names = launched_kernels(lambda: compare_bf16(f, D, tol=tol, hopper=False, q=q, k=k, v=v))
        route = attention_dropout_route(names, hopper and wgmma, Sq >= 128)
    with torch.no_grad():  # the dropout did something: without it the output differs
        q0, k0, v0 = (t.to(dtype) for t in (q, k, v))
        moved = (kernels.attention(q0, k0, v0, causal=causal, dropout_p=p, rng=rng, salt=salt)
                 - kernels.attention(q0, k0, v0, causal=causal)).abs().max().item()
    assert p == 0 or moved > 0, "dropout_p changed nothing"
    return f"|out with dropout - without| up to {moved:.2f}{route}"


def attention_dropout_route(names, hopper, whole_query_tile):
    """Checks that a bf16 case ran the kernels its shape and wgmma flag pick: on Hopper's (*_tma_kernel) the
    backward's dK/dV and dQ, and the forward where it has a whole query tile (128), else none of them; says
    which."""
    ours = {n.split("<")[0].split()[-1] for n in names if "attention_" in n}
    if not ours:  # the profiler saw nothing (e.g. under compute-sanitizer): the values were checked all the same
        return "; route not seen: the profiler recorded no kernel of ours"
    tma = {n for n in ours if n.endswith("_tma_kernel")}
    want = {"attention_bwd_dkv_tma_kernel", "attention_bwd_dq_tma_kernel"} if hopper else set()
    if hopper and whole_query_tile:
        want.add("attention_fwd_tma_kernel")
    assert tma == want, f"ran {sorted(ours)}, expected {sorted(want) or 'no *_tma_kernel'}"
    return f"; ran {', '.join(sorted(want))}" if want else "; ran mma.sync"


for _dt, _B, _H, _Sq, _Sk, _D, _causal, _extra in (
        (torch.float32, 1, 1, 1, 1, 64, False, {}),
        (torch.float32, 2, 3, 17, 17, 32, _C, {}),
        (torch.float32, 2, 3, 17, 70, 96, _C, {}),
        (torch.float32, 2, 3, 64, 64, 128, False, {}),
        (torch.float32, 2, 3, 1000, 1000, 64, _C, {}),
        (torch.float32, 2, 3, 100, 100, 64, _C, dict(p=0.9)),
        (torch.float32, 2, 3, 1, 300, 64, _C, {}),
        (torch.float32, 2, 8, 129, 129, 64, _C, dict(kv_heads=2)),
        (torch.float32, 1, 8, 129, 129, 128, _C, dict(kv_heads=2, packed=True)),
        (BF16, 2, 3, 17, 17, 64, _C, {}),
        (BF16, 2, 3, 1000, 1000, 64, _C, {}),
        (BF16, 2, 3, 1000, 1000, 64, _C, dict(wgmma=False)),
        (BF16, 2, 3, 256, 256, 128, False, {}),
        (BF16, 2, 3, 256, 256, 128, False, dict(wgmma=False)),
        (BF16, 2, 3, 200, 333, 128, _C, {}),
        (BF16, 1, 4, 1031, 1031, 64, False, dict(p=0.9)),
        (BF16, 2, 8, 300, 300, 64, _C, dict(kv_heads=2)),
        (BF16, 2, 8, 300, 300, 32, _C, dict(kv_heads=2)),
        (BF16, 2, 3, 200, 200, 96, _C, dict(p=0.9)),
        (BF16, 8, 6, 256, 256, 64, _C, dict(packed=True)),
        (BF16, 4, 8, 1024, 1024, 64, _C, {})):  # 256 query tiles: the persistent forward's blocks take several
    _name = (f"attention/dropout-{'bf16' if _dt == BF16 else 'fp32'}/b{_B}h{_H}_q{_Sq}k{_Sk}_d{_D}"
             + "_causal" * _causal + "".join(f"_{k}" if v is True else f"_{k}{v}" for k, v in _extra.items()))
    add(_name, t_attention_dropout, _dt, _B, _H, _Sq, _Sk, _D, _causal, **_extra)


def t_attention_dropout_deterministic_false():
    # deterministic=False asks the bf16 Hopper backward to add dQ across key blocks, which has no dropout:
    # with dropout the backward stays the deterministic one, bit for bit, its dQ kernel's
    if torch.cuda.get_device_capability() != (9, 0):
        raise Skip("deterministic=False changes the backward only on compute capability 9.0")
    q, k, v, dy = (rand(2, 3, 1000, 64).bfloat16() for _ in range(4))

    def run(deterministic):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = kernels.attention(*leaves, causal=True, deterministic=deterministic, dropout_p=0.2,
                                rng=dropout_rng(offset=9), salt=2)
        return (out, *torch.autograd.grad(out, leaves, dy))
    names = launched_kernels(lambda: run(False))
    for label, a, b in zip(("out", "dq", "dk", "dv"), run(False), run(True), strict=True):
        assert torch.equal(a, b), f"{label} differs from the deterministic backward's"
    assert not any("attention_bwd_dq_finish_kernel" in n for n in names), "dQ was added across key blocks"
    return "bit-equal to deterministic=True" + ("" if names else "; route not seen: the profiler recorded nothing")


add("attention/dropout-bf16/b2h3_q1000k1000_d64_causal_deterministicFalse", t_attention_dropout_deterministic_false)


def t_attention_dropout_graph_replay():
    # the training step's use: forward and backward captured with the offset's advance; every replay the
    # twin's output and gradients at that offset
    B, H, S, D = 2, 3, 40, 64
    q, k, v, dy = (rand(B, H, S, D) for _ in range(4))
    rng = dropout_rng(offset=0)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def step():
        rng[1:].add_(1)
        out = kernels.attention(*leaves, causal=True, dropout_p=0.3, rng=rng, salt=1)
        return (out, *torch.autograd.grad(out, leaves, dy))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    worst = 0.0
    for offset in (2, 3):  # the warm-up took 1
        graph.replay()
        ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref = train.torch_attention(*ref_in, causal=True, dropout_p=0.3, rng=dropout_rng(offset=offset), salt=1)
        refs = (ref, *torch.autograd.grad(ref, ref_in, dy.double()))
        for label, a, r in zip(("out", "dq", "dk", "dv"), static, refs, strict=True):
            check(f"{label}@offset{offset}", a, r, 1e-3)
            worst = max(worst, (a.double() - r).abs().max().item())
    return f"2 replays against the twin at offsets 2, 3: max |err| {worst:.1e}"


add("attention/dropout-fp32/graph_replay", t_attention_dropout_graph_replay)


def t_attention_kv_len(H, Sq, capacity, n_valid, D, causal=True, kv_heads=None):
    # A preallocated cache: keys past kv_len hold garbage (large values) that must not leak in.
    k, v = rand(1, kv_heads or H, capacity, D), rand(1, kv_heads or H, capacity, D)
    k[:, :, n_valid:], v[:, :, n_valid:] = 1e4, -1e4
    kv_len = torch.tensor([n_valid], device=DEV)
    with torch.no_grad():
        compare(lambda ops, q, k, v, n: ops.attention(q, k, v, causal=causal, kv_len=n), ATTN_TOL["fused-fp32"][0],
                q=rand(1, H, Sq, D), k=k, v=v, n=kv_len)


for _H, _Sq, _cap, _n, _D in ((8, 1, 256, 1, 96), (8, 1, 256, 37, 96), (8, 1, 256, 256, 96), (8, 5, 256, 70, 96),
                              (3, 17, 100, 17, 64), (2, 1, 64, 64, 32), (2, 64, 300, 129, 128)):
    add(f"attention/kv_len/h{_H}_q{_Sq}_cap{_cap}_len{_n}_d{_D}", t_attention_kv_len, _H, _Sq, _cap, _n, _D)
add("attention/kv_len/h3_q17_cap100_len40_d64_noncausal", t_attention_kv_len, 3, 17, 100, 40, 64, causal=False)
# a cache of 4096 splits its key tiles over 16 blocks: with 37 valid keys 15 of them see none
# fewer query rows a K/V head than a 64-row tile: 8 (2 heads x 4 queries, the first seeing one key), and 3
# against 1024 keys at D = 128
for _H, _Sq, _cap, _n, _D, _kv in ((8, 1, 256, 37, 96, 2), (8, 5, 256, 70, 64, 1), (8, 1, 4096, 4000, 128, 2),
                                  (8, 1, 4096, 37, 128, 2), (8, 4, 300, 4, 64, 4), (4, 3, 1024, 1024, 128, 4)):
    add(f"attention/kv_len/h{_H}_kv{_kv}_q{_Sq}_cap{_cap}_len{_n}_d{_D}", t_attention_kv_len, _H, _Sq, _cap, _n, _D,
        kv_heads=_kv)


# bf16 attention (fused only), against float64 on the same bf16-rounded inputs and against SDPA in
# bf16 (check_bf16: ours within tolerance and no less accurate than twice SDPA's error plus atol).
# P and dS are rounded to bf16 before their products, as in FlashAttention: each term of out = P V
# and of the gradients carries a relative error up to 2^-9, and every output one bf16 rounding
# (rtol 2^-8). The gradients sum P or dS terms over many queries or keys, and dk and dv over the
# group's query heads. dS carries delta = rowsum(dO * out) from the bf16-rounded out (as
# FlashAttention's does) and its own bf16 rounding: its error grows with the scale (relative to
# 1/sqrt(D)) and with the softmax's sharpness (q scaled by mag); dk = dS^T q carries q's mag on top.
# A sharp softmax leaves each output a few terms, whose P roundings do not average out: up to
# 2^-9 * |v| with v unit normals (|v| up to ~4), 8e-3, where the terms cancel to a small output.
def attn_bf16_tol(mag=1, group=1, scale_ratio=1.0):
    g = 1e-2 * math.sqrt(group)
    ds = 1.5 * g * scale_ratio * math.sqrt(mag)
    return {"out": (4e-3 if mag == 1 else 8e-3, 2**-8), "q": (ds, 2**-7), "k": (ds * mag, 2**-7), "v": (g, 2**-7)}


@contextlib.contextmanager
def attention_wgmma(on):
    """kernels.set_attention_wgmma(on) inside the block, the default (on) again after it."""
    kernels.set_attention_wgmma(on)
    try:
        yield
    finally:
        kernels.set_attention_wgmma(True)


def t_attention_bf16(B, H, Sq, Sk, D, causal, mag=1, scale=None, bshd=False, kv_heads=None, packed=False,
                     wgmma=True, deterministic=True):
    # wgmma=False: head size 64 on Hopper multiplies with mma.sync too (kernels.set_attention_wgmma);
    # deterministic=False: on Hopper (D 64, 128) the backward adds dQ across key blocks
    def qkv(S, heads, m=1):
        # bshd: (B, S, H, D) memory seen through a transpose, as a fused qkv projection leaves it
        return (rand(B, S, heads, D, scale=m).transpose(1, 2) if bshd else rand(B, heads, S, D, scale=m)).bfloat16()
    Hkv = kv_heads or H
    q, k, v = (packed_qkv(B, Sq, H, Hkv, D, torch.bfloat16) if packed
               else (qkv(Sq, H, mag), qkv(Sk, Hkv), qkv(Sk, Hkv)))
    assert not (bshd or packed) or not q.is_contiguous(), "the bshd case must hand the op a strided view"
    tol = attn_bf16_tol(mag, H // Hkv, 1.0 if scale is None else abs(scale) * math.sqrt(D))
    dy = rand(B, Sq, H, D).transpose(1, 2).bfloat16() if packed else None  # as in t_attention
    hopper = torch.cuda.get_device_capability() == (9, 0)
    if not wgmma and not hopper:
        raise Skip("wgmma=False differs from the default only on compute capability 9.0")
    if not deterministic and not (hopper and D in (64, 128)):
        raise Skip("deterministic=False changes the backward only at head sizes 64 and 128 on compute capability 9.0")
    seen = {}
    with attention_wgmma(wgmma):
        names = launched_kernels(lambda: compare_bf16(
            attention_recording_layout("fused-bf16", seen, {"deterministic": deterministic}, causal=causal,
                                       scale=scale), D, tol=tol, hopper=False, dy=dy,
            twin_nonfinite_ok=scale is not None and scale <= 0, q=q, k=k, v=v))
    assert seen["out_bshd"], "the fused op's out is not in (B, S, H, D) memory"
    return attention_route_taken(names, wgmma, deterministic)


@mutant("attention_deterministic_false_ignored", "attention/fused-bf16/b2h3_q1000k1000_d64_causal_deterministicFalse",
        "attention/fused-bf16/b1h2_q2048k2048_d128_deterministicFalse")
def _attention_deterministic_false_ignored():
    real = kernels.attention
    with unittest.mock.patch.object(kernels, "attention", lambda *a, **kw: real(*a, **{**kw, "deterministic": True})):
        yield


@mutant("attention_wgmma_false_ignored", "attention/fused-bf16/b2h3_q1000k1000_d64_causal_wgmmaFalse",
        "attention/dropout-bf16/b2h3_q1000k1000_d64_causal_wgmmaFalse")
def _attention_wgmma_false_ignored():
    with unittest.mock.patch.object(kernels, "set_attention_wgmma", lambda on: None):
        yield


@mutant("attention_dropout_off_hopper", "attention/dropout-bf16/b2h3_q1000k1000_d64_causal",
        "attention/dropout-bf16/b2h3_q256k256_d128")
def _attention_dropout_off_hopper():
    # bf16 attention with dropout on mma.sync where Hopper's kernels should run
    real = kernels.set_attention_wgmma
    try:
        with unittest.mock.patch.object(kernels, "set_attention_wgmma", lambda on: real(False)):
            yield
    finally:
        real(True)


def attention_route_taken(names, wgmma, deterministic):
    """Checks that a case named wgmma=False or deterministic=False ran that path (from the kernels' names), and
    says so; the default cases return nothing."""
    if wgmma and deterministic:
        return None
    ours = [n for n in names if "attention_" in n]
    if not ours:  # the profiler saw nothing (e.g. under compute-sanitizer): the values were checked all the same
        return "route not seen: the profiler recorded no kernel of ours"
    if not wgmma:
        assert not any("_tma_kernel" in n for n in ours), f"wgmma=False ran {sorted(set(ours))}"
        return "ran mma.sync (no *_tma_kernel)"
    assert any("attention_bwd_dq_finish_kernel" in n for n in ours), \
        f"deterministic=False did not add dQ across key blocks: ran {sorted({n.split('<')[0] for n in ours})}"
    return "dQ added across key blocks (attention_bwd_dq_finish_kernel ran)"


ATTN_BF16_CASES = [  # B, H, Sq, Sk, D, causal, extras
    (1, 1, 1, 1, 64, False, {}),
    (2, 3, 1, 1, 32, _C, {}),
    (2, 3, 17, 17, 32, False, {}),
    (2, 3, 17, 17, 64, _C, {}),
    (2, 3, 17, 17, 96, _C, {}),
    (2, 3, 17, 17, 128, _C, {}),
    (2, 3, 64, 64, 64, False, {}),
    (2, 3, 1000, 1000, 32, False, {}),
    (2, 3, 1000, 1000, 64, _C, {}),
    (2, 3, 1000, 1000, 96, _C, {}),
    (2, 3, 1000, 1000, 128, False, {}),
    (2, 3, 2048, 2048, 64, _C, {}),
    (1, 2, 2048, 2048, 128, False, {}),
    (2, 3, 1, 17, 128, False, {}),
    (2, 3, 1, 1000, 64, _C, {}),
    (2, 3, 17, 64, 64, _C, {}),
    (2, 3, 64, 1000, 32, _C, {}),
    (2, 3, 17, 2048, 128, _C, {}),
    (2, 3, 64, 2048, 96, False, {}),
    (2, 3, 1000, 1000, 64, _C, dict(mag=30)),
    (2, 3, 64, 64, 128, False, dict(mag=30)),
    (2, 3, 1, 2048, 64, _C, dict(mag=30)),
    (2, 3, 64, 64, 64, False, dict(scale=0.3)),
    (2, 3, 100, 100, 64, _C, dict(scale=-0.3)),
    (2, 3, 17, 70, 64, _C, dict(scale=0.0)),
    (2, 3, 1000, 1000, 64, _C, dict(bshd=True)),
    (2, 8, 17, 17, 64, _C, dict(kv_heads=2)),
    (2, 8, 1000, 1000, 64, _C, dict(kv_heads=2)),
    (1, 8, 2048, 2048, 128, False, dict(kv_heads=1)),
    (2, 6, 1, 1000, 96, _C, dict(kv_heads=3)),
    (1, 8, 129, 129, 64, _C, dict(kv_heads=2, bshd=True)),
    (2, 8, 1000, 1000, 64, _C, dict(kv_heads=4, mag=30)),
    (2, 3, 1000, 1000, 64, _C, dict(packed=True)),  # q, k, v in place in one projection's output
    (4, 6, 256, 256, 64, _C, dict(packed=True)),
    (1, 8, 129, 129, 128, _C, dict(kv_heads=2, packed=True)),
    # many key blocks against few query tiles, 32-query tiles of the backward at D = 96 and 128
    (1, 2, 300, 1000, 96, False, {}),
    (1, 4, 129, 1100, 128, _C, dict(kv_heads=2)),
    # the Hopper kernels (*_tma_kernel: D 64 and 128; the forward from 128 queries) at odd lengths,
    # causal with Sq < Sk (queries aligned to the last keys: the diagonal off the tile grid), every scale
    (1, 2, 200, 333, 128, _C, {}),
    (1, 2, 130, 384, 64, _C, {}),
    (2, 3, 130, 1, 128, False, {}),
    (2, 3, 200, 200, 128, _C, dict(scale=0.3)),
    (2, 3, 256, 256, 64, _C, dict(scale=-0.3)),
    (2, 3, 300, 300, 64, False, dict(scale=0.0)),
    (2, 3, 1000, 1000, 128, _C, dict(mag=30, bshd=True)),
    (2, 8, 777, 777, 128, _C, dict(kv_heads=2, packed=True)),
    # head size 64 on mma.sync as well (on Hopper it runs on wgmma by default)
    (2, 3, 1000, 1000, 64, _C, dict(wgmma=False)),
    (2, 8, 17, 17, 64, _C, dict(kv_heads=2, wgmma=False)),
    (2, 3, 1, 2048, 64, _C, dict(mag=30, wgmma=False)),
    # dQ added across key blocks (deterministic=False, at head sizes 64 and 128 on Hopper; skipped elsewhere)
    (2, 3, 17, 17, 64, _C, dict(deterministic=False)),
    (2, 3, 1000, 1000, 64, _C, dict(deterministic=False)),
    (2, 3, 1000, 1000, 128, _C, dict(deterministic=False)),
    (1, 2, 2048, 2048, 128, False, dict(deterministic=False)),
    (1, 2, 200, 333, 128, _C, dict(deterministic=False)),
    (1, 2, 130, 384, 64, _C, dict(deterministic=False)),
    (2, 3, 130, 1, 128, False, dict(deterministic=False)),
    (2, 8, 1000, 1000, 64, _C, dict(kv_heads=2, mag=30, deterministic=False)),
    (1, 8, 129, 129, 128, _C, dict(kv_heads=2, bshd=True, deterministic=False)),
    (2, 8, 777, 777, 128, _C, dict(kv_heads=2, packed=True, deterministic=False)),
    (2, 3, 300, 300, 64, False, dict(scale=-0.3, deterministic=False)),
]
for _B, _H, _Sq, _Sk, _D, _causal, _extra in ATTN_BF16_CASES:
    _name = f"attention/fused-bf16/b{_B}h{_H}_q{_Sq}k{_Sk}_d{_D}" + "_causal" * _causal
    _name += "".join(f"_{key}" if val is True else f"_{key}{val}" for key, val in _extra.items())
    add(_name, t_attention_bf16, _B, _H, _Sq, _Sk, _D, _causal, **_extra)


def t_attention_bf16_wgmma_choice():
    # Which kernels the bf16 attention runs, read from their names: on a compute capability 9.0 GPU the
    # forward and both backward kernels of the Hopper design (*_tma_kernel) at head sizes 64 and 128;
    # with set_attention_wgmma(False), and elsewhere, the mma.sync policy (AttnBf16) throughout.
    if torch.cuda.get_device_capability() != (9, 0):
        raise Skip("wgmma needs compute capability 9.0")

    def kind(name):
        return "tma" if "_tma_kernel" in name else "AttnBf16Wg" if "AttnBf16Wg" in name else \
            "AttnBf16" if "AttnBf16" in name else name
    seen = {}
    for D in (64, 128):
        q, k, v = (rand(2, 4, 300, D).bfloat16().requires_grad_() for _ in range(3))
        for on in (True, False):
            with attention_wgmma(on):
                names = launched_kernels(lambda: kernels.attention(q, k, v, causal=True).sum().backward())
            if not names:  # not even PyTorch's own: the profiler saw nothing (e.g. under compute-sanitizer)
                raise Skip("the profiler recorded no CUDA kernel, so the kernels' names cannot be read")
            for part in ("attention_fwd", "attention_bwd"):
                kinds = sorted({kind(n) for n in names if part in n})
                want = ["tma"] if on else ["AttnBf16"]
                seen[(D, on, part)] = kinds
                assert kinds == want, f"D={D} wgmma={on}: {part} ran {kinds}, expected {want}"
    return "; ".join(f"D={D} wgmma={on}: {part.split('_')[1]} {k[0]}" for (D, on, part), k in seen.items())


add("attention/fused-bf16/wgmma_choice", t_attention_bf16_wgmma_choice)


def t_attention_bf16_deterministic(B, H, S, D, causal, kv_heads=None):
    # Each gradient row is written by one block, its sums in a fixed order (dQ recomputes S and dP
    # rather than adding across key blocks; dK and dV add a group's heads in order): three backward
    # passes give bitwise the same gradients, many blocks running at a time.
    Hkv = kv_heads or H
    q, k, v = (rand(B, h, S, D).bfloat16().requires_grad_() for h in (H, Hkv, Hkv))
    dy = rand(B, H, S, D).bfloat16()
    runs = [torch.autograd.grad(kernels.attention(q, k, v, causal=causal), (q, k, v), dy) for _ in range(3)]
    for name, i in (("dq", 0), ("dk", 1), ("dv", 2)):
        for r in runs[1:]:
            assert torch.equal(runs[0][i], r[i]), \
                f"{name}: backward passes differ, by up to {(runs[0][i] - r[i]).float().abs().max().item():.2e}"
    assert runs[0][0].abs().max() > 0, "dq is all zeros"
    return "dq, dk, dv bitwise identical three times"


for _B, _H, _S, _D, _causal, _kv in ((4, 8, 2048, 64, False, None), (4, 8, 2048, 64, True, None),
                                     (2, 8, 1000, 128, True, 2), (1, 3, 1500, 96, False, None)):
    add(f"attention/fused-bf16/bwd_deterministic_b{_B}h{_H}_s{_S}_d{_D}" + "_causal" * _causal
        + f"_kv_heads{_kv}" * bool(_kv), t_attention_bf16_deterministic, _B, _H, _S, _D, _causal, _kv)


def t_attention_bf16_add_dq(B, H, S, D, causal, kv_heads=None):
    # deterministic=False on Hopper: one kernel adds dQ across key blocks (its finish kernel writes dq)
    # and the dQ kernel does not run; dk and dv are the deterministic kernel's bit for bit, dq agrees
    # with the deterministic one's to bf16 rounding (the fp32 sums' order differs).
    if torch.cuda.get_device_capability() != (9, 0):
        raise Skip("the Hopper backward needs compute capability 9.0")
    Hkv = kv_heads or H
    q, k, v = (rand(B, h, S, D).bfloat16().requires_grad_() for h in (H, Hkv, Hkv))
    dy = rand(B, H, S, D).bfloat16()
    det = torch.autograd.grad(kernels.attention(q, k, v, causal=causal), (q, k, v), dy)
    fast = []
    names = launched_kernels(lambda: fast.extend(torch.autograd.grad(
        kernels.attention(q, k, v, causal=causal, deterministic=False), (q, k, v), dy)))
    if not names:
        raise Skip("the profiler recorded no CUDA kernel, so the kernels' names cannot be read")
    ran = {n.split("<")[0].split()[-1] for n in names if "attention_bwd" in n}
    assert ran == {"attention_bwd_dkv_tma_kernel", "attention_bwd_dq_finish_kernel"}, f"backward ran {sorted(ran)}"
    for name, i in (("dk", 1), ("dv", 2)):
        assert torch.equal(det[i], fast[i]), \
            f"{name} differs from the deterministic path's by {(det[i] - fast[i]).float().abs().max().item():.2e}"
    err = ((det[0] - fast[0]).float().abs().max() / det[0].float().abs().max()).item()
    assert err < 2e-2, f"dq: max |deterministic - added| / max |dq| = {err:.2e}"  # ~2 bf16 steps of the max
    return f"dk, dv bitwise equal; dq max diff / max {err:.1e}; ran {sorted(ran)}"


for _B, _H, _S, _D, _causal, _kv in ((2, 4, 1000, 64, True, None), (2, 4, 777, 128, False, None),
                                     (1, 8, 1500, 128, True, 2)):
    add(f"attention/fused-bf16/add_dq_b{_B}h{_H}_s{_S}_d{_D}" + "_causal" * _causal + f"_kv_heads{_kv}" * bool(_kv),
        t_attention_bf16_add_dq, _B, _H, _S, _D, _causal, _kv)


def misaligned_bf16(*shape):
    t = rand(1 + math.prod(shape)).bfloat16()[1:].view(*shape)
    assert t.data_ptr() % 16, f"misaligned_bf16({shape}) is 16-byte aligned"
    return t


def t_attention_bf16_misaligned():
    # q, k, v and dout each start 2 bytes into an allocation (see t_attention_misaligned). The
    # references get aligned copies: SDPA's bf16 path (cuDNN on Hopper, torch 2.11) fails on these.
    B, H, S, D = 2, 3, 17, 64
    seen = {}

    def f(ops, q, k, v):
        if ops is not kernels:
            return ops.attention(q.clone(), k.clone(), v.clone()) * 1.0  # * 1.0: an aligned dout too
        out = ops.attention(q, k, v)
        seen.update({n: t.data_ptr() % 16 for n, t in (("q", q), ("k", k), ("v", v))})
        out.register_hook(lambda g: seen.update(dout=g.data_ptr() % 16))
        return out

    compare_bf16(f, D, tol=attn_bf16_tol(), hopper=False, dy=misaligned_bf16(B, H, S, D),
                 q=misaligned_bf16(B, H, S, D), k=misaligned_bf16(B, H, S, D), v=misaligned_bf16(B, H, S, D))
    assert sorted(seen) == ["dout", "k", "q", "v"] and all(seen.values()), f"address mod 16 seen by the op: {seen}"
    return "q, k, v, dout at address mod 16 = " + ", ".join(str(seen[n]) for n in ("q", "k", "v", "dout"))


add("attention/fused-bf16/misaligned_qkv_dout", t_attention_bf16_misaligned)


def t_attention_bf16_kv_len(H, Sq, capacity, n_valid, D, causal=True, kv_heads=None):
    # the cache's keys past kv_len hold large values that must not leak in (see t_attention_kv_len)
    k, v = rand(1, kv_heads or H, capacity, D), rand(1, kv_heads or H, capacity, D)
    k[:, :, n_valid:], v[:, :, n_valid:] = 1e4, -1e4
    kv_len = torch.tensor([n_valid], device=DEV)
    with torch.no_grad():
        compare_bf16(lambda ops, q, k, v, n: ops.attention(q, k, v, causal=causal, kv_len=n), D, grad=False,
                     tol=attn_bf16_tol(), hopper=False, q=rand(1, H, Sq, D), k=k, v=v, n=kv_len)


# one query per head against caches of 1024 and 8192 keys (the key tiles split over blocks, some
# seeing no valid key), a few queries, grouped heads, every head size
for _H, _Sq, _cap, _n, _D, _kv in ((8, 1, 1024, 1000, 64, None), (8, 1, 8192, 8000, 128, None),
                                  (8, 1, 8192, 37, 128, 2), (8, 1, 256, 1, 96, None), (8, 5, 256, 70, 64, 1),
                                  (3, 17, 100, 17, 32, None), (2, 64, 300, 129, 128, None), (8, 4, 300, 4, 64, 4),
                                  (4, 3, 1024, 1024, 128, None), (2, 8, 1024, 1000, 32, None)):
    add(f"attention/fused-bf16/kv_len/h{_H}_kv{_kv or _H}_q{_Sq}_cap{_cap}_len{_n}_d{_D}", t_attention_bf16_kv_len,
        _H, _Sq, _cap, _n, _D, kv_heads=_kv)
add("attention/fused-bf16/kv_len/h3_q17_cap100_len40_d64_noncausal", t_attention_bf16_kv_len, 3, 17, 100, 40, 64,
    causal=False)


# Empty inputs: empty outputs and zero gradients.
add("empty/attention_fused_q0k5", t_attention, "fused-fp32", 1, 2, 0, 5, 64, False)
add("empty/attention_fused-bf16_q0k5", t_attention_bf16, 1, 2, 0, 5, 64, False)


def t_attention_nan_scale(dt):
    # scale=nan: every score NaN, so every output and gradient, as SDPA gives them
    q, k, v = (_leaf(2, 3, 17, 64, dtype=dt) for _ in range(3))
    out = kernels.attention(q, k, v, scale=float("nan"))
    twin = F.scaled_dot_product_attention(q, k, v, scale=float("nan"))
    assert out.isnan().all() and twin.isnan().all(), f"ours {out.isnan().float().mean():.2f} NaN"
    out.sum().backward()
    assert all(t.grad.isnan().all() for t in (q, k, v)), "a gradient is not all NaN"
    return "out and dq, dk, dv all NaN, as SDPA's out"


for _dt, _tag in ((torch.float32, "fp32"), (BF16, "bf16")):
    add(f"dispatcher/attention_nan_scale_{_tag}", t_attention_nan_scale, _dt)


def t_stress_attention(B, H, Hkv, S, D, dtype):
    q = rand(B, H, S, D).to(dtype).requires_grad_()
    k, v = (rand(B, Hkv, S, D).to(dtype).requires_grad_() for _ in range(2))
    return stress(lambda: grads(kernels.attention(q, k, v, causal=True), [q, k, v]))


for _dt, _tag in ((torch.float32, "fp32"), (BF16, "bf16")):
    add(f"stress/attention_b2h8kv2_s1000_d128_causal_{_tag}", t_stress_attention, 2, 8, 2, 1000, 128, _dt)


def _qkv(*shapes):
    return [rand(*s) for s in shapes]


bad_inputs(
    ("attention_B_mismatch", RuntimeError,
     lambda: kernels.attention(*_qkv((2, 3, 17, 64), (1, 3, 17, 64), (1, 3, 17, 64))), ("attention", ("q", "k", "v"))),
    ("attention_H_mismatch", RuntimeError,
     lambda: kernels.attention(*_qkv((2, 3, 17, 64), (2, 2, 17, 64), (2, 2, 17, 64))), ("attention", ("q", "k", "v"))),
    ("attention_gqa_heads_not_multiple", RuntimeError,
     lambda: kernels.attention(*_qkv((2, 6, 17, 64), (2, 4, 17, 64), (2, 4, 17, 64))), ("attention", "q", "k")),
    ("attention_more_kv_heads_than_q", RuntimeError,
     lambda: kernels.attention(*_qkv((2, 2, 17, 64), (2, 4, 17, 64), (2, 4, 17, 64))), ("attention", "q", "k")),
    ("attention_zero_heads", RuntimeError,
     lambda: kernels.attention(*_qkv((2, 0, 17, 64), (2, 1, 17, 64), (2, 1, 17, 64))), ("attention", "q", "head")),
    ("attention_D_mismatch", RuntimeError,
     lambda: kernels.attention(*_qkv((2, 3, 17, 64), (2, 3, 17, 32), (2, 3, 17, 32))), ("attention", ("q", "k", "v"))),
    ("attention_kv_length_mismatch", RuntimeError,
     lambda: kernels.attention(*_qkv((2, 3, 17, 64), (2, 3, 17, 64), (2, 3, 16, 64))), ("attention", ("k", "v"))),
    ("attention_fused_D48", ValueError,
     lambda: kernels.attention(*_qkv(*[(2, 3, 17, 48)] * 3), mode="fused"), ("32", "64", "128")),
    ("attention_float64_v", RuntimeError,
     lambda: kernels.attention(*_qkv((2, 3, 17, 64), (2, 3, 17, 64)), rand(2, 3, 17, 64).double()),
     ("attention", "v")),
    ("attention_bf16_q_float32_k", RuntimeError,
     lambda: kernels.attention(rand(2, 3, 17, 64).bfloat16(), *_qkv((2, 3, 17, 64), (2, 3, 17, 64))),
     ("attention", "k", "BFloat16", "like", "q")),
    ("attention_float32_q_bf16_v", RuntimeError,
     lambda: kernels.attention(*_qkv((2, 3, 17, 64), (2, 3, 17, 64)), rand(2, 3, 17, 64).bfloat16()),
     ("attention", "v", "Float", "q")),
    ("attention_bf16_tiled", ValueError,
     lambda: kernels.attention(*[t.bfloat16() for t in _qkv(*[(2, 3, 17, 64)] * 3)], mode="tiled"),
     ("attention", "bfloat16", "fused")),
    ("attention_cpu_q", RuntimeError,
     lambda: kernels.attention(torch.randn(2, 3, 17, 64), *_qkv((2, 3, 17, 64), (2, 3, 17, 64))),
     ("attention", "q")),
    # string arguments: only the values the op knows
    ("attention_mode_flash", ValueError, lambda: kernels.attention(*_qkv(*[(1, 2, 5, 32)] * 3), mode="flash"),
     ("attention", "mode", "flash")),
    ("attention_precision_fp16", ValueError,
     lambda: kernels.attention(*_qkv(*[(1, 2, 5, 32)] * 3), precision="fp16"), ("attention", "precision", "fp16")),
    # dropout: fused mode, with an rng, p in [0, 1]
    ("attention_dropout_tiled", ValueError,
     lambda: kernels.attention(*_qkv(*[(1, 2, 5, 48)] * 3), mode="tiled", dropout_p=0.1, rng=dropout_rng()),
     ("attention", "dropout_p", "fused")),
    ("attention_dropout_no_rng", RuntimeError, lambda: kernels.attention(*_qkv(*[(1, 2, 5, 32)] * 3), dropout_p=0.1),
     ("attention", "rng", "None")),
    ("attention_dropout_rows_past_2_32", ValueError,  # expanded views: the check comes before any copy
     lambda: kernels.attention(*(rand(1, 1, 1, 32).expand(2**16, 2**8, 2**8 + 1, 32) for _ in range(3)),
                               dropout_p=0.1, rng=dropout_rng()), ("attention", "2^32")),
    ("attention_dropout_p_above_1", ValueError,
     lambda: kernels.attention(*_qkv(*[(1, 2, 5, 32)] * 3), dropout_p=1.5, rng=dropout_rng()), ("attention", "p")),
    # kv_len: one int64 on q's GPU, fused mode, no gradient
    ("attention_kv_len_int32", RuntimeError,
     lambda: kernels.attention(*_qkv((1, 2, 1, 32), (1, 2, 9, 32), (1, 2, 9, 32)), causal=True, kv_len=_pos(5).int()),
     ("attention", "kv_len", "int64")),
    ("attention_kv_len_cpu", RuntimeError,
     lambda: kernels.attention(*_qkv((1, 2, 1, 32), (1, 2, 9, 32), (1, 2, 9, 32)), causal=True,
                               kv_len=torch.tensor([5])), ("attention", "kv_len", "CUDA")),
    ("attention_kv_len_two_elements", RuntimeError,
     lambda: kernels.attention(*_qkv((1, 2, 1, 32), (1, 2, 9, 32), (1, 2, 9, 32)), causal=True, kv_len=_pos(5, 6)),
     ("attention", "kv_len", "1-element")),
    ("attention_kv_len_tiled", ValueError,
     lambda: kernels.attention(*_qkv((1, 2, 1, 32), (1, 2, 9, 32), (1, 2, 9, 32)), causal=True, mode="tiled",
                               kv_len=_pos(5)), ("attention", "kv_len", "fused")),
    ("attention_kv_len_q_requires_grad", RuntimeError,
     lambda: kernels.attention(rand(1, 2, 1, 32).requires_grad_(), *_qkv((1, 2, 9, 32), (1, 2, 9, 32)), causal=True,
                               kv_len=_pos(5)), ("attention", "kv_len", "no_grad")),
)


@opcheck_args
def opcheck_attention(dt):
    plain, k = _plain(dt), torch.ops.kernels
    q, kk, v = _leaf(2, 4, 17, 64, dtype=dt), _leaf(2, 2, 17, 64, dtype=dt), _leaf(2, 2, 17, 64, dtype=dt)
    pq, pk, pv = plain(2, 4, 17, 64), plain(2, 2, 17, 64), plain(2, 2, 17, 64)
    out, lse_log2 = k.attention_fused(pq, pk, pv, True, 0.125, True, None, 0.0, None, 0)
    rng = dropout_rng()
    cases = [("attention_causal_gqa", k.attention, (q, kk, v), {"causal": True}),
             ("attention_added_dq", k.attention, (q, kk, v), {"causal": True, "deterministic": False}),
             ("attention_dropout", k.attention, (q, kk, v), {"causal": True, "dropout_p": 0.2, "rng": rng, "salt": 3}),
             ("attention_fused", k.attention_fused, (pq, pk, pv, True, 0.125, True, None, 0.2, rng, 3), {}),
             ("attention_fused_backward", k.attention_fused_backward,
              (pq, pk, pv, out, lse_log2, plain(2, 4, 17, 64), True, 0.125, True, True, 0.2, rng, 3), {}),
             ("attention_kv_len", k.attention, (pq[:, :, :1], pk, pv),
              {"causal": True, "kv_len": torch.tensor([9], device=DEV)})]
    qkv = _leaf(2, 17, (4 + 2 + 2) * 64, dtype=dt)  # the model's q, k, v: views of one projection
    pq2, pk2, pv2 = (t.view(2, 17, -1, 64).transpose(1, 2) for t in qkv.split([4 * 64, 2 * 64, 2 * 64], -1))
    cases.append(("attention_packed_qkv", k.attention, (pq2, pk2, pv2), {"causal": True}))
    packed = plain(2, 17, (4 + 2 + 2) * 64)  # the backward of q, k, v viewed from one buffer writes one buffer
    pq3, pk3, pv3 = (t.view(2, 17, -1, 64).transpose(1, 2) for t in packed.split([4 * 64, 2 * 64, 2 * 64], -1))
    out3, lse3 = k.attention_fused(pq3, pk3, pv3, True, 0.125, True, None, 0.0, None, 0)
    cases.append(("attention_fused_backward_packed", k.attention_fused_backward_packed,
                  (pq3, pk3, pv3, out3, lse3, plain(2, 4, 17, 64), True, 0.125, True, True, 0.0, None, 0), {}))
    if dt == torch.float32:  # tiled attention takes float32 only
        tiled_qkv = (plain(2, 4, 9, 40), plain(2, 2, 11, 40), plain(2, 2, 11, 40))
        cases += [("attention_tiled", k.attention, (_leaf(2, 4, 9, 40), _leaf(2, 2, 11, 40), _leaf(2, 2, 11, 40)),
                   {"causal": True, "mode": "tiled"}),
                  ("attention_tiled_forward", k.attention_tiled, (*tiled_qkv, True, 0.125), {}),
                  ("attention_tiled_backward", k.attention_tiled_backward,
                   (*tiled_qkv, k.attention_tiled(*tiled_qkv, True, 0.125)[1], plain(2, 4, 9, 40), 0.125), {})]
    return cases


def attention_fns(causal):
    """name -> f(q, k, v) for the four implementations compared."""
    def ours(**kw):
        return lambda q, k, v: kernels.attention(q, k, v, causal=causal, **kw)
    return {"sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
            "tiled": ours(mode="tiled"),
            "fused": ours(mode="fused", precision="fp32"),
            "fused-tf32": ours(mode="fused", precision="tf32")}


def fwd_bwd(fn, leaves, dout):
    return torch.autograd.grad(fn(*leaves), leaves, dout)


def time_attention(fns, pas, q, k, v, dout, kv_len=None):
    """Each attention of fns (name -> f(q, k, v, ...)) on one pass: 'fwd', 'fwd+bwd' (the gradients of q, k
    and v for dout) or 'decode' (a forward without autograd, attending to the first kv_len keys). Returns
    each one's median ms and output, as two dicts by name; one that runs out of GPU memory gets ms None
    and no output, and its memory is released before the next one runs."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ms, outs = {}, {}
    for name, fn in fns.items():
        if pas == "decode":
            run = functools.partial(torch.no_grad()(fn), q, k, v, kv_len=kv_len)
        elif pas == "fwd":
            run = functools.partial(fn, q, k, v)
        else:
            run = functools.partial(fwd_bwd, fn, leaves, dout)
        try:
            outs[name] = run()
            ms[name] = time_ms(run)
        except torch.cuda.OutOfMemoryError:
            outs.pop(name, None)
            ms[name] = None
            torch.cuda.empty_cache()
    return ms, outs


ATTN_BENCH_BHD = (4, 8, 64)
ATTN_BENCH_S = (128, 512, 1024, 2048, 4096)
ATTN_MEMORY_S = (1024, 2048, 4096)


@bench_rows("attention")
def bench_attention(rows):
    B, H, D = ATTN_BENCH_BHD
    print(f"\nattention fp32, B={B} H={H} D={D}; SDPA = F.scaled_dot_product_attention, default backend")
    cols = ["S", "causal", "pass", "SDPA ms", "tiled ms", "fused ms", "fused-tf32 ms", "SDPA/fused",
            "SDPA/fused-tf32", "fused TFLOP/s", "check vs SDPA"]
    print(md_row(cols))
    print(md_row(["---"] * len(cols)))
    for S in ATTN_BENCH_S:
        for causal in (False, True):
            q, k, v, dout = (rand(B, H, S, D) for _ in range(4))
            flops = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
            for pas, flop_mult in (("fwd", 1.0), ("fwd+bwd", 3.5)):  # backward does 2.5x the forward's matmuls
                ms, outs = time_attention(attention_fns(causal), pas, q, k, v, dout)
                checks, all_ok = [], True
                for name in ("tiled", "fused", "fused-tf32"):
                    if name in outs and "sdpa" in outs:
                        ok, text = rel_check(outs[name], outs["sdpa"], 1e-2 if name == "fused-tf32" else 2e-4)
                        all_ok &= ok
                        checks.append(f"{name} {text}")
                    else:
                        checks.append(f"{name} OOM")
                ratio = {n: ms["sdpa"] / ms[n] if ms["sdpa"] and ms[n] else None for n in ("fused", "fused-tf32")}
                tflops = flops * flop_mult / (ms["fused"] * 1e-3) / 1e12 if ms["fused"] else None
                rows.append(dict(op="attention", shape=f"B{B} H{H} S{S} D{D}", causal=causal, **{"pass": pas},
                                 sdpa_ms=ms["sdpa"], tiled_ms=ms["tiled"], fused_ms=ms["fused"],
                                 fused_tf32_ms=ms["fused-tf32"], sdpa_over_fused=ratio["fused"],
                                 sdpa_over_fused_tf32=ratio["fused-tf32"], fused_tflops=tflops,
                                 check_ok=all_ok, check=", ".join(checks)))
                print(md_row([str(S), str(causal), pas,
                              *(fmt(ms[n], ".4f") for n in ("sdpa", "tiled", "fused", "fused-tf32")),
                              fmt(ratio["fused"], ".2f") + "x", fmt(ratio["fused-tf32"], ".2f") + "x",
                              fmt(tflops, ".1f"), ", ".join(checks)]), flush=True)


def peak_extra_mb(fn, leaves, dout):
    """Peak memory of one forward+backward above what was allocated before it (inputs excluded)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    try:
        grads = fwd_bwd(fn, leaves, dout)
        torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None
    del grads
    return (torch.cuda.max_memory_allocated() - base) / 2**20


@bench_rows("attention")
def bench_attention_memory(rows):
    B, H, D = ATTN_BENCH_BHD
    names = ("sdpa", "tiled", "fused")
    print(f"\nattention peak extra memory, forward+backward, B={B} H={H} D={D}, causal=False (MB; inputs excluded)")
    print(md_row(["S", "SDPA MB", "tiled MB", "fused MB"]))
    print(md_row(["---"] * 4))
    for S in ATTN_MEMORY_S:
        leaves = [rand(B, H, S, D).requires_grad_() for _ in range(3)]
        dout = rand(B, H, S, D)
        fns = attention_fns(False)
        mb = {n: peak_extra_mb(fns[n], leaves, dout) for n in names}
        rows.append(dict(op="attention memory", shape=f"B{B} H{H} S{S} D{D}", causal=False,
                         **{f"{n}_mb": mb[n] for n in names}))
        print(md_row([str(S)] + [fmt(mb[n], ".0f") for n in names]), flush=True)


ATTN_BF16_BENCH = [  # B, H, Sq, Sk, D, causal, passes
    # 16k tokens of a 2048-wide model at each length, as FlashAttention-3's paper measures
    *[(16384 // S, 2048 // D, S, S, D, c, ("fwd", "fwd+bwd")) for D in (64, 128)
      for S in (512, 1024, 2048, 4096, 8192, 16384) for c in (False, True)],
    (64, 6, 256, 256, 64, True, ("fwd", "fwd+bwd")),  # the large preset's training step
    *[(4, 8, 1, S, D, True, ("decode",)) for S in (1024, 8192) for D in (64, 128)],  # one new token per head
]


@bench_rows("attention_bf16")
def bench_attention_bf16(rows):
    """bf16 fused attention against SDPA in bf16 (its default backend) in the same run. Decode rows:
    one query per head against a cache of Sk keys, kv_len = Sk - 1 (SDPA gets the equivalent mask),
    rated by the K/V bytes read."""
    print("\nattention bf16; SDPA = F.scaled_dot_product_attention in bf16, default backend (the repo's causal "
          "alignment; a mask where it differs from is_causal); SDPA-FA2 = the same restricted to its "
          "FlashAttention-2 backend (none where that takes no mask: decode)")
    # on Hopper ours runs the forward and backward kernels of the Hopper design (D 64 and 128); "ours
    # mma.sync" is the same call with kernels.set_attention_wgmma(False), the kernels other GPUs run;
    # "ours, dQ added" is fwd+bwd with deterministic=False (dQ added across key blocks, as SDPA's cuDNN
    # backward does)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    cols = ["B", "H", "Sq", "Sk", "D", "causal", "pass", "SDPA ms", "SDPA-FA2 ms", "ours ms", "ours mma.sync ms",
            "ours, dQ added ms", "SDPA/ours", "SDPA/ours, dQ added", "SDPA-FA2/ours", "ours rate", "check vs SDPA"]
    print(md_row(cols))
    print(md_row(["---"] * len(cols)))

    def sdpa(q, k, v, kv_len=None):
        return train.torch_attention(q, k, v, causal=causal, kv_len=kv_len)

    def sdpa_fa2(q, k, v, kv_len=None):
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            return sdpa(q, k, v, kv_len)
    fns = {"sdpa": sdpa, "sdpa-fa2": sdpa_fa2,
           "ours": lambda q, k, v, kv_len=None: kernels.attention(q, k, v, causal=causal, kv_len=kv_len),
           "ours-added": lambda q, k, v, kv_len=None: kernels.attention(q, k, v, causal=causal, deterministic=False)}
    for B, H, Sq, Sk, D, causal, passes in ATTN_BF16_BENCH:
        q, dout = (rand(B, H, Sq, D).bfloat16() for _ in range(2))
        k, v = (rand(B, H, Sk, D).bfloat16() for _ in range(2))
        kv_len = torch.tensor([Sk - 1], device=DEV)
        for pas in passes:
            names = ("sdpa", "sdpa-fa2", "ours") + (("ours-added",) if pas == "fwd+bwd" else ())
            ms, outs = time_attention({n: fns[n] for n in (names if pas != "decode" else ("sdpa", "ours"))}, pas, q,
                                      k, v, dout, kv_len)
            mma = None
            if hopper and D in (64, 128):
                with attention_wgmma(False):
                    mma = time_attention({"ours": fns["ours"]}, pas, q, k, v, dout, kv_len)[0]["ours"]
            ok, text = rel_check(outs["ours"], outs["sdpa"], 2e-2)
            if pas == "decode":
                rate, unit = 2 * B * H * Sk * D * 2 / (ms["ours"] * 1e-3) / 1e9, "GB/s"
            else:  # matmul flops; the backward does 2.5x the forward's
                flops = 4 * B * H * Sq * Sk * D * (0.5 if causal else 1.0) * (3.5 if pas == "fwd+bwd" else 1.0)
                rate, unit = flops / (ms["ours"] * 1e-3) / 1e12, "TFLOP/s"
            ratio = ms["sdpa"] / ms["ours"]
            fa2, added = ms.get("sdpa-fa2"), ms.get("ours-added")
            rows.append(dict(op="attention bf16", shape=f"B{B} H{H} Sq{Sq} Sk{Sk} D{D}", causal=causal,
                             **{"pass": pas}, sdpa_ms=ms["sdpa"], sdpa_fa2_ms=fa2, ours_ms=ms["ours"],
                             ours_mma_sync_ms=mma, ours_added_ms=added, sdpa_over_ours=ratio,
                             sdpa_over_ours_added=added and ms["sdpa"] / added,
                             sdpa_fa2_over_ours=fa2 and fa2 / ms["ours"], rate=rate,
                             unit=unit, check_ok=ok, check=text))
            print(md_row([str(B), str(H), str(Sq), str(Sk), str(D), str(causal), pas, f"{ms['sdpa']:.4f}",
                          fmt(fa2, ".4f") if fa2 else "-", f"{ms['ours']:.4f}", fmt(mma, ".4f") if mma else "-",
                          fmt(added, ".4f") if added else "-", f"{ratio:.2f}x",
                          f"{ms['sdpa'] / added:.2f}x" if added else "-",
                          f"{fa2 / ms['ours']:.2f}x" if fa2 else "-", f"{rate:.1f} {unit}", text]), flush=True)


GQA_BENCH = (4, 8, 2)  # B, H_q, H_kv: four query heads share each K/V head
GQA_BENCH_S = (1024, 4096)
GQA_DECODE_S = (256, 1024, 8192)  # one query per head against a cache this long, D 128, H_kv 8 (MHA) and 2


ATTN_DROPOUT_P = 0.1
ATTN_DROPOUT_BENCH = [(64, 6, 256, 64, True), (16, 16, 1024, 64, True), (16, 16, 1024, 128, False),
                      (8, 16, 2048, 128, True)]  # B, H, S, D, causal: the large preset's step first


@bench_rows("attention dropout")
def bench_attention_dropout(rows):
    """Attention with dropout on the probabilities: ours (the masks drawn inside the fused kernels, Hopper's for bf16)
    against SDPA with dropout_p (the backend PyTorch picks for it), and both without dropout, in the same run.
    The masks differ, so ours is checked against the twin with its own masks."""
    p, rng = ATTN_DROPOUT_P, dropout_rng()
    print(f"\nattention with dropout p={p}; SDPA = F.scaled_dot_product_attention(dropout_p={p}), default backend")
    cols = ["dtype", "B", "H", "S", "D", "causal", "pass", "SDPA ms", "ours ms", "SDPA/ours", "SDPA p=0 ms",
            "ours p=0 ms", "check vs twin"]
    print(md_row(cols))
    print(md_row(["---"] * len(cols)))
    for dtype in (torch.float32, BF16):
        for B, H, S, D, causal in ATTN_DROPOUT_BENCH:
            q, k, v, dout = (rand(B, H, S, D).to(dtype) for _ in range(4))
            fns = {"sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal),
                   "ours": lambda q, k, v: kernels.attention(q, k, v, causal=causal, dropout_p=p, rng=rng),
                   "sdpa0": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                   "ours0": lambda q, k, v: kernels.attention(q, k, v, causal=causal)}
            twin = train.torch_attention(q, k, v, causal=causal, dropout_p=p, rng=rng).float()
            for pas in ("fwd", "fwd+bwd"):
                ms, outs = time_attention(fns, pas, q, k, v, dout)
                ok, text = (rel_check(outs["ours"].float(), twin, 2e-4 if dtype == torch.float32 else 2e-2)
                            if pas == "fwd" else (None, "-"))
                ratio = ms["sdpa"] / ms["ours"] if ms["sdpa"] and ms["ours"] else None
                name = "bf16" if dtype == BF16 else "fp32"
                rows.append(dict(op="attention dropout", shape=f"{name} B{B} H{H} S{S} D{D}", causal=causal,
                                 **{"pass": pas}, sdpa_ms=ms["sdpa"], ours_ms=ms["ours"], sdpa_over_ours=ratio,
                                 sdpa_p0_ms=ms["sdpa0"], ours_p0_ms=ms["ours0"], check_ok=ok, check=text))
                print(md_row([name, str(B), str(H), str(S), str(D), str(causal), pas,
                              *(fmt(ms[n], ".4f") for n in ("sdpa", "ours")), fmt(ratio, ".2f") + "x",
                              *(fmt(ms[n], ".4f") for n in ("sdpa0", "ours0")), text]), flush=True)


@bench_rows("attention gqa")
def bench_gqa(rows):
    """Grouped-query attention: ours against SDPA with the K/V heads repeated (the torch op set's twin)
    and against SDPA's own enable_gqa; the ratio is to the faster of the two."""
    B, H, Hkv = GQA_BENCH
    print(f"\ngrouped-query attention fp32, causal, B={B} H_q={H} H_kv={Hkv}; SDPA with K/V repeated "
          f"(repeat_interleave, the torch op set's twin) and SDPA enable_gqa=True")
    cols = ["S", "D", "pass", "SDPA repeat ms", "SDPA enable_gqa ms", "fused ms", "best SDPA/fused", "check"]
    print(md_row(cols))
    print(md_row(["---"] * len(cols)))
    fns = {"repeat": lambda q, k, v, **kw: train.TORCH_OPS.attention(q, k, v, causal=True, **kw),
           "enable_gqa": lambda q, k, v, kv_len=None: F.scaled_dot_product_attention(
               q, k, v, is_causal=kv_len is None, enable_gqa=True,
               attn_mask=None if kv_len is None else torch.arange(k.shape[2], device=DEV) < kv_len),
           "fused": lambda q, k, v, **kw: kernels.attention(q, k, v, causal=True, **kw)}
    cases = [(S, D, pas, B, Hkv) for S in GQA_BENCH_S for D in (64, 128) for pas in ("fwd", "fwd+bwd")]
    cases += [(S, 128, "decode", 1, h) for S in GQA_DECODE_S for h in (H, Hkv)]
    for S, D, pas, b, hkv in cases:
        k, v = rand(b, hkv, S, D), rand(b, hkv, S, D)
        q, dout = (rand(b, H, 1 if pas == "decode" else S, D) for _ in range(2))
        kv_len = torch.tensor([S - 1], device=DEV)  # a cache one short of full, as in decoding
        ms, outs = time_attention(fns, pas, q, k, v, dout, kv_len)
        best = min(t for n, t in ms.items() if n != "fused" and t)
        ok, text = rel_check(outs["fused"], outs["repeat"], 2e-4)
        rows.append(dict(op="attention gqa", shape=f"B{b} Hq{H} Hkv{hkv} S{S} D{D}", causal=True, **{"pass": pas},
                         sdpa_repeat_ms=ms["repeat"], sdpa_enable_gqa_ms=ms["enable_gqa"], fused_ms=ms["fused"],
                         best_sdpa_over_fused=best / ms["fused"], check_ok=ok, check=text))
        print(md_row([str(S), str(D), pas + (f" (Sq=1, B=1, H_kv={hkv})" if pas == "decode" else ""),
                      *(fmt(ms[n], ".4f") for n in fns), f"{best / ms['fused']:.2f}x", text]), flush=True)


# ==== op: sinkhorn ====
# sinkhorn against its float64 twin, P and the logits' gradient, n from 1 to 8, logits up to 1e3, 1 to 64
# iterations; its bad inputs, opcheck arguments and bench rows.


def sinkhorn_tol(scale):
    """(atol, rtol) for P and dlogits when the logits are randn * scale. fp32 holds a logit of size s
    to about s * 6e-8, and Sinkhorn carries that resolution into P and into the gradient. An fp32 CPU
    emulation of the kernel's arithmetic, against float64, erred by up to 2e-6 at s = 30 and 2.2e-5
    at s = 1e3 (M = 4096, every n the kernels take, iters 1 to 20), in P and in dlogits alike; a wrong half-step order
    or a slip in the backward errs by ~0.1."""
    return (1e-6 + scale * 1e-7, 1e-5)


def t_sinkhorn(shape, scale, iters=20, transposed=False):
    # transposed: the logits arrive as a non-contiguous view
    logits = rand(*shape, scale=scale)
    logits = logits.transpose(-1, -2) if transposed else logits
    tol = sinkhorn_tol(scale)
    compare(lambda ops, logits: ops.sinkhorn(logits, iters=iters), tol, tol, logits=logits)


def t_sinkhorn_rows_sum_to_one(M):
    # the last half-step normalises the rows: they sum to 1 up to a few fp32 ulps per entry, even
    # where |logits| ~ 1e3 (the kernel subtracts each row's max before its log-sum-exp)
    for n in (1, 2, 4, 8):
        for scale in (1, 30, 1e3):
            p = kernels.sinkhorn(rand(M, n, n, scale=scale))
            check(f"n{n}_x{scale:g}", p.double().sum(-1), torch.ones(M, n, dtype=torch.float64, device=DEV), 2e-6)


for _M in (1, 24, 4096):
    for _n in (1, 2, 4, 8):
        for _scale in (30, 1e3):
            add(f"sinkhorn/{_M}x{_n}x{_n}_x{_scale:g}", t_sinkhorn, (_M, _n, _n), _scale)
for _iters in (1, 7):
    for _n in (1, 2, 4, 8):
        for _scale in (30, 1e3):
            add(f"sinkhorn/24x{_n}x{_n}_x{_scale:g}_iters{_iters}", t_sinkhorn, (24, _n, _n), _scale, iters=_iters)
for _n in (1, 4, 8):  # 64 iterations: the backward's lse pass SINKHORN_LSE_SMEM and go to the workspace
    add(f"sinkhorn/300x{_n}x{_n}_x30_iters64", t_sinkhorn, (300, _n, _n), 30, iters=64)
for _n in (3, 5, 6, 7):  # the other sizes the kernel is compiled for
    add(f"sinkhorn/24x{_n}x{_n}_x30", t_sinkhorn, (24, _n, _n), 30)
add("sinkhorn/2x12x4x4", t_sinkhorn, (2, 12, 4, 4), 1)
add("sinkhorn/2x12x4x4_x30_transposed", t_sinkhorn, (2, 12, 4, 4), 30, transposed=True)
add("sinkhorn/4096_rows_sum_to_1", t_sinkhorn_rows_sum_to_one, 4096)


# Empty inputs: empty outputs and zero gradients.
add("empty/sinkhorn_0x4x4", t_sinkhorn, (0, 4, 4), 1)
add("empty/sinkhorn_2x0x8x8", t_sinkhorn, (2, 0, 8, 8), 1)


bad_inputs(
    ("sinkhorn_n9", ValueError, lambda: kernels.sinkhorn(rand(4, 9, 9)), ("sinkhorn", "n")),
    ("sinkhorn_not_square", RuntimeError, lambda: kernels.sinkhorn(rand(4, 3)), ("sinkhorn", "logits")),
    ("sinkhorn_iters0", ValueError, lambda: kernels.sinkhorn(rand(2, 4, 4), iters=0), ("sinkhorn", "iters")),
    ("sinkhorn_float64", RuntimeError, lambda: kernels.sinkhorn(rand(2, 4, 4).double()), ("sinkhorn", "logits")),
    ("sinkhorn_cpu", RuntimeError, lambda: kernels.sinkhorn(torch.randn(2, 4, 4)), ("sinkhorn", "logits")),
)


@opcheck_args
def opcheck_sinkhorn(dt):
    if dt != torch.float32:  # the mHC ops take float32 only
        return []
    plain, k = _plain(dt), torch.ops.kernels
    return [("sinkhorn", k.sinkhorn, (_leaf(3, 5, 4, 4),), {"iters": 7}),
            ("sinkhorn_backward", k.sinkhorn_backward, (plain(3, 4, 4), plain(3, 4, 4), 5), {})]


@bench_rows("ops")
def bench_sinkhorn(rows):
    # mHC's residual mixing: one 4x4 matrix per sublayer (M = 1) or per token, 20 iterations; eager PyTorch
    # launches over ten small kernels per iteration in each direction, ours one kernel per pass
    for M in (1, 24, 4096):
        bench_op(rows, "sinkhorn", f"{M}x4x4 iters=20", "fwd+bwd", lambda ops, logits: ops.sinkhorn(logits, 20),
                 [rand(M, 4, 4)], M, "M matrices/s")


# ==== op: hc_coeffs, hc_project, hc_pre, hc_mix_pre ====
# mhc-dynamic's coefficients, projection and their fused forms against the float64 twins in a row, every
# stream count n, unused outputs, a bf16 y; their bad inputs, opcheck arguments and bench rows.


def t_hc_coeffs(lead, n, scale, iters=20):
    # mhc-dynamic's coefficients: h (*lead, 2n + n^2) of randn * scale, alpha (3,) and bias (K,) of randn,
    # so the logits alpha h + bias reach about 3 * scale. dalpha and dbias are sums over the tokens: their
    # atol grows with the terms summed, at least 5x the errors these cases showed on an H100 (one token's
    # terms lost from a sum err by ~0.1 to ~10)
    K, M = 2 * n + n * n, math.prod(lead)
    tol = sinkhorn_tol(3 * scale)
    grad_tol = {"h": tol, "bias": (tol[0] + 1e-7 * M, 1e-4), "alpha": (tol[0] + 1e-8 * M * K * scale, 1e-4)}
    compare(lambda ops, h, alpha, bias: ops.hc_coeffs(h, alpha, bias, iters), tol, grad_tol,
            h=rand(*lead, K, scale=scale), alpha=rand(3), bias=rand(K))


for _lead in ((1,), (24,), (4096,), (2, 65), (0,)):
    for _n in (1, 2, 4, 8):
        add(f"hc_coeffs/{'x'.join(map(str, _lead))}_n{_n}", t_hc_coeffs, _lead, _n, 1.0)
for _n in (3, 5, 6, 7):  # the other sizes the kernel is compiled for, with larger logits
    add(f"hc_coeffs/24_n{_n}_x30", t_hc_coeffs, (24,), _n, 30.0)
add("hc_coeffs/300_n4_x30_iters7", t_hc_coeffs, (300,), 4, 30.0, iters=7)
add("hc_coeffs/300_n4_x30_iters64", t_hc_coeffs, (300,), 4, 30.0, iters=64)  # lse in the workspace


def t_hc_project(lead, n, C, x=None):
    # mhc-dynamic's projection of the flattened streams, RMSNorm(x, w) phi^T, against F.rms_norm and F.linear:
    # a dot product of length D = nC per output, and dw sums over the tokens, so tolerances as a matmul's
    K, D = 2 * n + n * n, n * C
    tol = mm_tol(math.prod(lead), D, K)
    compare(lambda ops, x, w, phi: ops.hc_project(x, w, phi), tol, tol,
            x=rand(*lead, D) if x is None else x, w=rand(D), phi=rand(K, D))


# every n the kernels are compiled for; odd D takes the scalar path; D past one block's staged columns (n = 8 and
# C >= 64, C = 768, n = 7 and C = 101) is summed over column ranges
for _n in range(1, 9):
    add(f"hc_project/5_n{_n}_C3", t_hc_project, (5,), _n, 3)
for _lead, _n, _C in (((1,), 4, 256), ((24,), 4, 256), ((4096,), 4, 256), ((2, 65), 3, 37), ((300,), 8, 64),
                      ((7,), 2, 1), ((12,), 4, 768), ((3,), 8, 2048), ((0,), 4, 8), ((130,), 4, 257),
                      ((33,), 7, 101)):
    add(f"hc_project/{'x'.join(map(str, _lead))}_n{_n}_C{_C}", t_hc_project, _lead, _n, _C)
add("hc_project/9_n4_C64_misaligned", lambda: t_hc_project((9,), 4, 64, x=misaligned(9, 256)))


def t_hc_pre(lead, n, C, used=(True, True, True), iters=20):
    # hc_pre = hc_coeffs(hc_project(x flattened)) and the merge, against the twins in a row: the merged stream and
    # H_post, H_res, and the gradients of all five inputs. phi / sqrt(D) keeps the projections near 1, so the
    # logits alpha h + bias are a few units. used: which outputs the loss takes (an unused one's gradient is zeros)
    K, D, M = 2 * n + n * n, n * C, math.prod(lead)
    tol = (max(mm_tol(M, D, K), sinkhorn_tol(3)[0]), 1e-5)
    chosen = [i for i, u in enumerate(used) if u]
    def f(ops, x, w, phi, alpha, bias):  # one call, its unused outputs' gradients undefined
        out = ops.hc_pre(x, w, phi, alpha, bias, iters)
        return tuple(out[i] for i in chosen)
    compare(f, tol, tol, x=rand(*lead, n, C), w=rand(D), phi=rand(K, D, scale=D ** -0.5), alpha=rand(3), bias=rand(K))


for _lead, _n, _C in (((1,), 1, 3), ((5,), 2, 3), ((24,), 4, 256), ((4096,), 4, 256), ((2, 65), 3, 37), ((300,), 8, 64),
                      ((12,), 4, 768), ((33,), 7, 101), ((0,), 4, 8), ((7,), 5, 1)):
    add(f"hc_pre/{'x'.join(map(str, _lead))}_n{_n}_C{_C}", t_hc_pre, _lead, _n, _C)
add("hc_pre/24_n4_C64_merged_unused", t_hc_pre, (24,), 4, 64, used=(False, True, True))
add("hc_pre/24_n4_C64_only_merged", t_hc_pre, (24,), 4, 64, used=(True, False, False))
add("hc_pre/300_n4_C64_iters40", t_hc_pre, (300,), 4, 64, iters=40)  # the lse in the workspace


def t_hc_mix_pre(lead, n, C, per_token=True, used=(True,) * 4, y_dtype=torch.float32):
    # hc_mix_pre = the previous sublayer's stream_mix, then hc_pre of the mixed streams s, against the twins in a
    # row: (s, merged, H_post, H_res) and the gradients of all eight inputs, the one of s (from the next sublayer)
    # added to hc_pre's inside the op. used: which outputs the loss takes. y_dtype bf16: mixed precision's y
    K, D, M = 2 * n + n * n, n * C, math.prod(lead)
    tol = (max(mm_tol(M, D, K), sinkhorn_tol(3)[0]), 1e-5)
    chosen = [i for i, u in enumerate(used) if u]
    coef = lead if per_token else ()
    inputs = dict(x=rand(*lead, n, C), h_res=rand(*coef, n, n, scale=0.5), h_post=rand(*coef, n), y=rand(*lead, C),
                  w=rand(D), phi=rand(K, D, scale=D ** -0.5), alpha=rand(3), bias=rand(K))

    def f(ops, x, h_res, h_post, y, w, phi, alpha, bias):  # one call: a bf16 y's gradient is not summed in bf16
        out = ops.hc_mix_pre(x, h_res, h_post, y, w, phi, alpha, bias)
        return tuple(out[i] for i in chosen)
    if y_dtype == torch.float32:
        compare(f, tol, tol, **inputs)
    else:
        inputs["y"] = inputs["y"].to(y_dtype)
        compare_dtypes(*on_both(f), tol, tol, (torch.float32,) * len(chosen), **inputs)


for _lead, _n, _C in (((1,), 1, 3), ((24,), 4, 256), ((4096,), 4, 256), ((2, 65), 3, 37), ((300,), 8, 64),
                      ((12,), 4, 768), ((0,), 4, 8)):
    add(f"hc_mix_pre/{'x'.join(map(str, _lead))}_n{_n}_C{_C}", t_hc_mix_pre, _lead, _n, _C)
add("hc_mix_pre/24_n4_C64_static", t_hc_mix_pre, (24,), 4, 64, per_token=False)
add("hc_mix_pre/24_n4_C64_streams_unused", t_hc_mix_pre, (24,), 4, 64, used=(False, True, True, True))
add("hc_mix_pre/24_n4_C64_post_res_unused", t_hc_mix_pre, (24,), 4, 64, used=(True, True, False, False))
add("hc_mix_pre_bf16/37_n4_C256", t_hc_mix_pre, (37,), 4, 256, y_dtype=BF16)
add("hc_mix_pre_bf16/5_n3_C7", t_hc_mix_pre, (5,), 3, 7, y_dtype=BF16)
add("hc_mix_pre_bf16/24_n4_C64_static", t_hc_mix_pre, (24,), 4, 64, per_token=False, y_dtype=BF16)


bad_inputs(
    ("hc_coeffs_K10", ValueError, lambda: kernels.hc_coeffs(rand(4, 10), rand(3), rand(10)), ("hc_coeffs", "2n + n^2")),
    ("hc_coeffs_K99", ValueError, lambda: kernels.hc_coeffs(rand(4, 99), rand(3), rand(99)), ("hc_coeffs", "h")),
    ("hc_coeffs_alpha_size", RuntimeError, lambda: kernels.hc_coeffs(rand(4, 24), rand(4), rand(24)),
     ("hc_coeffs", "alpha")),
    ("hc_coeffs_bias_size", RuntimeError, lambda: kernels.hc_coeffs(rand(4, 24), rand(3), rand(23)),
     ("hc_coeffs", "bias")),
    ("hc_coeffs_cpu", RuntimeError, lambda: kernels.hc_coeffs(torch.randn(4, 24), rand(3), rand(24)),
     ("hc_coeffs", "h")),
    ("hc_project_K10", ValueError, lambda: kernels.hc_project(rand(4, 12), rand(12), rand(10, 12)), ("hc_project", "phi")),
    ("hc_project_phi_cols", RuntimeError, lambda: kernels.hc_project(rand(4, 12), rand(12), rand(8, 13)),
     ("hc_project", "phi")),
    ("hc_project_weight_size", RuntimeError, lambda: kernels.hc_project(rand(4, 12), rand(11), rand(8, 12)),
     ("hc_project", "weight")),
    ("hc_project_cpu", RuntimeError, lambda: kernels.hc_project(torch.randn(4, 12), rand(12), rand(8, 12)),
     ("hc_project", "x")),
    ("hc_project_D0", RuntimeError, lambda: kernels.hc_project(rand(4, 0), rand(0), rand(8, 0)), ("hc_project", "x")),
    ("hc_mix_pre_phi_rows", RuntimeError,
     lambda: kernels.hc_mix_pre(rand(4, 2, 3), rand(4, 2, 2), rand(4, 2), rand(4, 3), rand(6), rand(15, 6), rand(3),
                                rand(15)), ("hc_mix_pre", "phi", "8")),
    ("hc_mix_pre_y_float64", RuntimeError,
     lambda: kernels.hc_mix_pre(rand(4, 2, 3), rand(4, 2, 2), rand(4, 2), rand(4, 3).double(), rand(6), rand(8, 6),
                                rand(3), rand(8)), ("hc_mix_pre", "y", "float32 or bfloat16")),
    ("hc_pre_phi_rows", RuntimeError, lambda: kernels.hc_pre(rand(4, 2, 3), rand(6), rand(15, 6), rand(3), rand(15)),
     ("hc_pre", "phi")),
    ("hc_pre_x_dims", RuntimeError, lambda: kernels.hc_pre(rand(6), rand(6), rand(8, 6), rand(3), rand(8)),
     ("hc_pre", "x")),
    ("hc_coeffs_iters0", ValueError, lambda: kernels.hc_coeffs(rand(4, 24), rand(3), rand(24), iters=0),
     ("hc_coeffs", "iters")),
)


@opcheck_args
def opcheck_hc(dt):
    if dt != torch.float32:  # the mHC ops take float32 only
        return []
    plain, k = _plain(dt), torch.ops.kernels
    return [("hc_coeffs", k.hc_coeffs, (_leaf(2, 3, 15), _leaf(3), _leaf(15)), {"iters": 5}),
            ("hc_project", k.hc_project, (_leaf(2, 3, 12), _leaf(12), _leaf(8, 12)), {}),
            ("hc_project_forward", k.hc_project_forward, (plain(5, 12), plain(12), plain(8, 12), 1e-5), {}),
            ("hc_pre", k.hc_pre, (_leaf(2, 3, 4, 5), _leaf(20), _leaf(24, 20), _leaf(3), _leaf(24)), {"iters": 5}),
            ("hc_pre_forward", k.hc_pre_forward, (plain(5, 2, 3), plain(6), plain(8, 6), plain(3), plain(8), 3,
                                                  1e-5), {}),
            ("hc_mix_pre", k.hc_mix_pre, (_leaf(2, 3, 4, 5), _leaf(2, 3, 4, 4), _leaf(2, 3, 4), _leaf(2, 3, 5),
                                          _leaf(20), _leaf(24, 20), _leaf(3), _leaf(24)), {"iters": 5}),
            ("hc_mix_pre_forward", k.hc_mix_pre_forward,
             (plain(5, 2, 3), plain(5, 2, 2), plain(5, 2), plain(5, 3), plain(6), plain(8, 6), plain(3), plain(8), 3,
              1e-5), {}),
            ("hc_mix_pre_backward", k.hc_mix_pre_backward,
             (plain(5, 2, 3), plain(5, 2, 2), plain(5, 2), plain(5, 3), plain(5, 2, 3), plain(6), plain(8, 6),
              plain(3), plain(8), plain(5, 8), plain(5).abs(), plain(5, 2), plain(5, 2, 3), plain(5, 3),
              plain(5, 2), plain(5, 2, 2), 3), {}),
            ("hc_pre_backward", k.hc_pre_backward, (plain(5, 2, 3), plain(6), plain(8, 6), plain(3), plain(8),
                                                    plain(5, 8), plain(5).abs(), plain(5, 2), plain(5, 3),
                                                    plain(5, 2), plain(5, 2, 2), 3), {}),
            ("hc_project_backward", k.hc_project_backward, (plain(5, 12), plain(12), plain(8, 12), plain(5, 8),
                                                            plain(5).abs(), plain(5, 8)), {}),
            ("hc_coeffs_backward", k.hc_coeffs_backward, (plain(5, 24), plain(3), plain(24), plain(5, 4),
                                                          plain(5, 4), plain(5, 4, 4), 3), {})]


@bench_rows("ops")
def bench_hc(rows):
    # mhc-dynamic's coefficients for the sweep's 4096 tokens: PyTorch's scale, add, slices, sigmoids and
    # Sinkhorn (and their sums over tokens backward) against one kernel each way
    bench_op(rows, "hc_coeffs", "4096x24 n=4 iters=20", "fwd+bwd",
             lambda ops, h, alpha, bias: ops.hc_coeffs(h, alpha, bias, 20), [rand(4096, 24), rand(3), rand(24)], 4096,
             "M tokens/s")
    # mhc-dynamic's projection at the sweep's shape (4096 tokens, 4 streams of 256) and 768 wide: PyTorch's
    # RMSNorm and linear against one kernel each way. The bytes the pair must move: x read forward, x read and dx
    # written backward
    bench_op(rows, "hc_pre", "4096x4x256 iters=20", "fwd+bwd",
             lambda ops, x, w, phi, a, b: ops.hc_pre(x, w, phi, a, b, 20),
             [rand(4096, 4, 256), rand(1024), rand(24, 1024, scale=1 / 32), rand(3), rand(24)], 4096, "M tokens/s")
    for M, D in ((4096, 4 * 256), (4096, 4 * 768)):
        bench_op(rows, "hc_project", f"{M}x{D} n=4", "fwd+bwd", lambda ops, x, w, phi: ops.hc_project(x, w, phi),
                 [rand(M, D), rand(D), rand(24, D)], 12 * M * D, "GB/s")


# ==== op: stream_merge, stream_mix, stream_mix_merge ====
# mHC's stream mixing against the float64 twins, forward and backward, static and per-token coefficients,
# n from 1 to 8, views and misaligned inputs, a bf16 y; their bad inputs, opcheck arguments and bench rows.


# Stream mixing (mhc.py's hyper-connections). out, dx and dy sum at most n + 1 <= 9 products: a few
# fp32 ulps of values up to ~20. The coefficient gradients sum `terms` products (C of them per token,
# times the tokens when static); an fp32 CPU emulation of the kernels' summation order erred by up to
# 5e-4 at 1M terms (|ref| ~ 2e3), 2e-5 at 1000; an indexing slip errs by O(|ref|).
STREAM_TOL = (1e-5, 1e-5)


def stream_coef_tol(terms):
    return (1e-5 * math.sqrt(max(terms, 1)), 1e-5)


def stream_x(lead, n, C, layout):
    """x (*lead, n, C): contiguous; 'transposed', a (..., C, n) tensor's view (copied by the op);
    'misaligned', contiguous at an offset of one float (not 16-byte aligned: the scalar path)."""
    if layout == "transposed":
        return rand(*lead, C, n).transpose(-1, -2)
    if layout == "misaligned":
        return misaligned(*lead, n, C)
    return rand(*lead, n, C)


def t_stream_merge(lead, n, C, per_token, layout="contiguous"):
    coef = lead if per_token else ()
    terms = C * (1 if per_token else math.prod(lead))
    compare(lambda ops, x, h: ops.stream_merge(x, h), STREAM_TOL, dict(x=STREAM_TOL, h=stream_coef_tol(terms)),
            x=stream_x(lead, n, C, layout), h=rand(*coef, n))


def mix_op(merge, used=(True, True)):
    """f(ops, **inputs): stream_mix, or with merge stream_mix_merge (the mix and the next sublayer's merge of it,
    both outputs and both gradients going through one kernel each way), which takes h_pre too. used: which of
    stream_mix_merge's outputs the loss takes (an unused one's gradient comes back undefined: zeros)."""
    if merge:
        def f(ops, x, h_res, h_post, y, h_pre):  # one call
            return tuple(o for o, u in zip(ops.stream_mix_merge(x, h_res, h_post, y, h_pre), used, strict=True) if u)
        return f
    return lambda ops, x, h_res, h_post, y: ops.stream_mix(x, h_res, h_post, y)


def mix_inputs(n, coef, x, y, merge):
    inputs = dict(x=x, h_res=rand(*coef, n, n), h_post=rand(*coef, n), y=y)
    if merge:
        inputs["h_pre"] = rand(*coef, n)
    return inputs


def t_stream_mix(lead, n, C, per_token, layout="contiguous", merge=False, used=(True, True)):
    coef = lead if per_token else ()
    ctol = stream_coef_tol(C * (1 if per_token else math.prod(lead)))
    compare(mix_op(merge, used), STREAM_TOL, dict(x=STREAM_TOL, y=STREAM_TOL, h_res=ctol, h_post=ctol, h_pre=ctol),
            unreached=() if used[1] else ("h_pre",),  # merged unused: h_pre reaches nothing
            **mix_inputs(n, coef, stream_x(lead, n, C, layout), rand(*lead, C), merge))


def t_stream_mix_bf16(lead, n, C, per_token, merge, y_misaligned=False):
    """Mixed precision (--dtype=bf16): fp32 streams and coefficients, the sublayer's output y in bf16; fp32 math,
    dy back in bf16. Against the twin with y's bf16 values (mhc.stream_mix_torch, autocast off) and float64."""
    coef = lead if per_token else ()
    ctol = stream_coef_tol(C * (1 if per_token else math.prod(lead)))
    y = rand(*lead, C).to(BF16)
    if y_misaligned:  # 2 bytes into its allocation: not 8-byte aligned, the scalar path
        y = torch.empty(1 + y.numel(), dtype=BF16, device=DEV)[1:].view(y.shape).copy_(y)
    compare_dtypes(*on_both(mix_op(merge)), STREAM_TOL,
                   dict(x=STREAM_TOL, y=STREAM_TOL, h_res=ctol, h_post=ctol, h_pre=ctol),
                   (torch.float32,) * (2 if merge else 1), **mix_inputs(n, coef, rand(*lead, n, C), y, merge))


# (leading dims, n, C, per-token coefficients): n = 1, 2, 4, 8 (and 3, 5, 6, 7 once), C = 1, 7, 256,
# 1000, tokens = 1, 37, 4096, each static and per token somewhere; and 65536 static tokens, so that each warp
# of the backward walks dozens of them (stream_coef_rows)
STREAM_CASES = [((1,), 1, 1, False), ((1,), 8, 1000, True), ((37,), 1, 256, True), ((37,), 2, 7, False),
                ((37,), 4, 1000, False), ((37,), 8, 7, True), ((1, 37), 4, 256, True), ((1, 37), 8, 256, False),
                ((32, 128), 4, 256, False), ((32, 128), 4, 256, True), ((4096,), 2, 1000, True),
                ((4096,), 8, 7, False), ((32, 128), 1, 1, True), ((37,), 3, 20, True), ((37,), 5, 12, False),
                ((37,), 6, 1000, True), ((37,), 7, 256, False), ((64, 1024), 2, 4, False)]
for _op, _t in (("stream_merge", t_stream_merge), ("stream_mix", t_stream_mix),
                ("stream_mix_merge", functools.partial(t_stream_mix, merge=True))):
    for _lead, _n, _C, _tok in STREAM_CASES:
        add(f"{_op}/{'x'.join(map(str, _lead))}x{_n}x{_C}_" + ("per_token" if _tok else "static"), _t, _lead, _n, _C,
            _tok)
    for _tok in (False, True):
        for _layout in ("transposed", "misaligned"):
            add(f"{_op}/37x4x256_{'per_token' if _tok else 'static'}_{_layout}", _t, (37,), 4, 256, _tok, _layout)
        add(f"empty/{_op}_0x4x256_{'per_token' if _tok else 'static'}", _t, (0,), 4, 256, _tok)
    add(f"empty/{_op}_5x4x0_static", _t, (5,), 4, 0, False)  # C = 0: zero coefficient gradients
for _tok, _used in ((False, (False, True)), (True, (True, False))):
    add(f"stream_mix_merge/37x4x256_{'per_token' if _tok else 'static'}_{'merged' if _used[0] else 'streams'}_unused",
        functools.partial(t_stream_mix, merge=True, used=_used), (37,), 4, 256, _tok)
for _merge in (False, True):
    _op = "stream_mix_merge" if _merge else "stream_mix"
    for _lead, _n, _C, _tok in (((37,), 4, 256, False), ((37,), 4, 256, True), ((2, 65), 8, 768, True),
                                ((4096,), 4, 256, False), ((37,), 3, 7, True), ((1,), 1, 1, False)):
        add(f"{_op}_bf16/{'x'.join(map(str, _lead))}x{_n}x{_C}_" + ("per_token" if _tok else "static"),
            t_stream_mix_bf16, _lead, _n, _C, _tok, _merge)
    add(f"{_op}_bf16/37x4x256_per_token_y_misaligned", t_stream_mix_bf16, (37,), 4, 256, True, _merge, True)


bad_inputs(
    ("stream_merge_n9", ValueError, lambda: kernels.stream_merge(rand(4, 9, 8), rand(9)), ("stream_merge", "n")),
    ("stream_mix_n9", ValueError, lambda: kernels.stream_mix(rand(4, 9, 8), rand(9, 9), rand(9), rand(4, 8)),
     ("stream_mix", "n")),
    ("stream_mix_y_C", RuntimeError, lambda: kernels.stream_mix(rand(4, 2, 8), rand(2, 2), rand(2), rand(4, 7)),
     ("stream_mix", "y")),
    ("stream_merge_h_n", RuntimeError, lambda: kernels.stream_merge(rand(4, 2, 8), rand(3)), ("stream_merge", "h")),
    ("stream_merge_h_tokens", RuntimeError, lambda: kernels.stream_merge(rand(4, 2, 8), rand(5, 2)),
     ("stream_merge", "h")),
    ("stream_mix_h_res_shape", RuntimeError,
     lambda: kernels.stream_mix(rand(4, 2, 8), rand(2, 3), rand(2), rand(4, 8)), ("stream_mix", "h_res")),
    ("stream_mix_static_res_per_token_post", RuntimeError,
     lambda: kernels.stream_mix(rand(4, 2, 8), rand(2, 2), rand(4, 2), rand(4, 8)), ("stream_mix", "h_res", "h_post")),
    ("stream_merge_cpu_x", RuntimeError, lambda: kernels.stream_merge(torch.randn(4, 2, 8), rand(2)),
     ("stream_merge", "x")),
    ("stream_mix_cpu_y", RuntimeError,
     lambda: kernels.stream_mix(rand(4, 2, 8), rand(2, 2), rand(2), torch.randn(4, 8)), ("stream_mix", "y")),
    ("stream_merge_float64_h", RuntimeError, lambda: kernels.stream_merge(rand(4, 2, 8), rand(2).double()),
     ("stream_merge", "h")),
    ("stream_mix_float64_x", RuntimeError,
     lambda: kernels.stream_mix(rand(4, 2, 8).double(), rand(2, 2), rand(2), rand(4, 8)), ("stream_mix", "x")),
)


@opcheck_args
def opcheck_stream(dt):
    if dt != torch.float32:  # the mHC ops take float32 only
        return []
    plain, k = _plain(dt), torch.ops.kernels
    xs, ys = _leaf(2, 3, 4, 37), _leaf(2, 3, 37)  # streams and y of 2 x 3 tokens; coefficients static and per token
    return [("stream_merge", k.stream_merge, (xs, _leaf(4)), {}),
            ("stream_merge_per_token", k.stream_merge, (xs, _leaf(2, 3, 4)), {}),
            ("stream_merge_backward", k.stream_merge_backward, (plain(2, 3, 4, 37), plain(4), plain(2, 3, 37)),
             {}),
            ("stream_mix", k.stream_mix, (xs, _leaf(4, 4), _leaf(4), ys), {}),
            ("stream_mix_per_token", k.stream_mix, (xs, _leaf(2, 3, 4, 4), _leaf(2, 3, 4), ys), {}),
            ("stream_mix_bf16_y", k.stream_mix, (xs, _leaf(4, 4), _leaf(4), _leaf(2, 3, 37, dtype=BF16)), {}),
            ("stream_mix_merge", k.stream_mix_merge, (xs, _leaf(4, 4), _leaf(4), ys, _leaf(4)), {}),
            ("stream_mix_merge_per_token", k.stream_mix_merge,
             (xs, _leaf(2, 3, 4, 4), _leaf(2, 3, 4), _leaf(2, 3, 37, dtype=BF16), _leaf(2, 3, 4)), {}),
            ("stream_mix_merge_backward", k.stream_mix_merge_backward,
             (plain(2, 3, 4, 37), plain(4, 4), plain(4), plain(2, 3, 37), plain(4), plain(2, 3, 4, 37),
              plain(2, 3, 37)), {}),
            ("stream_mix_backward", k.stream_mix_backward,
             (plain(2, 3, 4, 37), plain(4, 4), plain(4), plain(2, 3, 37), plain(2, 3, 4, 37)), {})]


@bench_rows("ops")
def bench_stream(rows):
    # mHC's stream mixing at the sweep's shape, static and per-token coefficients; the bytes each pass
    # must move: merge fwd reads x, writes out; its bwd reads dout and x, writes dx. mix fwd reads x
    # and y, writes out; its bwd reads dout, x and y, writes dx and dy. mix_merge writes merged too, and its
    # bwd reads dmerged. Plus the coefficients: read by each pass, their gradient written.
    B, T, n, C = 32, 128, 4, 256
    M = B * T
    for per_token in (False, True):
        lead, kind = ((B, T), "per-token") if per_token else ((), "static")
        x, y, h, h_res, h_post = rand(B, T, n, C), rand(B, T, C), rand(*lead, n), rand(*lead, n, n), rand(*lead, n)
        k_merge, k_mix = n * (M if per_token else 1), (n * n + n) * (M if per_token else 1)
        k_mm = k_mix + k_merge
        shape = f"{B}x{T}x{n}x{C} {kind}"
        for pas, nbytes in (("fwd", M * (n * C + C) + k_merge), ("fwd+bwd", M * (3 * n * C + 2 * C) + 3 * k_merge)):
            bench_op(rows, "stream_merge", shape, pas, lambda ops, x, h: ops.stream_merge(x, h), [x, h], 4 * nbytes,
                     "GB/s")
        for pas, nbytes in (("fwd", M * (2 * n * C + C) + k_mix), ("fwd+bwd", M * (5 * n * C + 3 * C) + 3 * k_mix)):
            bench_op(rows, "stream_mix", shape, pas, lambda ops, *ins: ops.stream_mix(*ins), [x, h_res, h_post, y],
                     4 * nbytes, "GB/s")
        for pas, nbytes in (("fwd", M * (2 * n * C + 2 * C) + k_mm), ("fwd+bwd", M * (5 * n * C + 5 * C) + 3 * k_mm)):
            bench_op(rows, "stream_mix_merge", shape, pas, lambda ops, *ins: ops.stream_mix_merge(*ins),
                     [x, h_res, h_post, y, h], 4 * nbytes, "GB/s")


# ==== op: decode_megakernel ====
# decode_megakernel's op-level material: its opcheck arguments and its bench (its cases decode whole models:
# inference/gpu_megakernel_*, with inference.py's tests).


def _megakernel_supported(dt):
    return kernels.decode_megakernel_why_not(64, 2, 2, 1, torch.empty((), dtype=dt).element_size()) is None


@opcheck_args
def opcheck_decode_megakernel(dt):
    """decode_megakernel's opcheck cases where the GPU runs it (Hopper): a 1-layer model 64 wide, 2 heads, 11
    tokens, a cache of 64 positions: gpt, llama (one K/V head, SwiGLU 192 wide, with its RoPE tables), and gpt
    with a mixture of 3 experts of which a token takes 2 (top_k)."""
    if not _megakernel_supported(dt):
        return []
    plain = _plain(dt)
    C, H, E = 64, train.swiglu_hidden(64), 3
    gpt_layer = {"ln_1_w": (C,), "ln_1_b": (C,), "attn_w": (3 * C, C), "attn_b": (3 * C,), "attn_proj_w": (C, C),
                 "attn_proj_b": (C,), "ln_2_w": (C,), "ln_2_b": (C,), "mlp.fc_w": (4 * C, C), "mlp.fc_b": (4 * C,),
                 "mlp.proj_w": (C, 4 * C), "mlp.proj_b": (C,)}
    llama_layer = {"ln_1_w": (C,), "attn_w": (2 * C, C), "attn_proj_w": (C, C), "ln_2_w": (C,), "mlp.fc_w": (H, C),
                   "mlp.up_w": (H, C), "mlp.proj_w": (C, H)}
    moe_layer = {**gpt_layer, **{n: (E, *shape) for n, shape in gpt_layer.items() if n.startswith("mlp.")},
                 "mlp.router_w": (E, C)}
    order = kernels.LIMITS["megakernel_layer_weights"]  # a layer's weights go in this order

    def in_order(layer):
        return [layer[n] for n in order if n in layer]
    gpt = [(11, C), (64, C), (C,), (C,)] + in_order(gpt_layer)
    llama = [(11, C), (C,)] + in_order(llama_layer)
    moe = gpt[:4] + in_order(moe_layer)
    cases = []
    for name, shapes, n_kv, kw in (("gpt", gpt, 2, {}),
                                   ("llama", llama, 1, dict(rope_cos=torch.rand(64, 16, device=DEV),
                                                            rope_sin=torch.rand(64, 16, device=DEV))),
                                   ("gpt_moe", moe, 2, dict(top_k=2))):
        workspace = torch.zeros(kernels.decode_megakernel_workspace_floats(C, 2, kw.get("top_k", 0)), device=DEV)
        args = ([plain(*s) for s in shapes], torch.tensor([[3]], device=DEV), torch.tensor([5], device=DEV),
                plain(1, 1, n_kv, 64, 32), plain(1, 1, n_kv, 64, 32), plain(11), workspace, 2)
        cases.append((f"decode_megakernel_{name}", torch.ops.kernels.decode_megakernel, args, kw))
    return cases


MK_STEPS = "ABCDE"  # a layer's steps in decode_megakernel: norm + QKV, attention, out-proj, norm + fc, mlp proj


def megakernel_done_ready(stamps):
    """A decode_megakernel trace (blocks, 2 + 10 n_layer ns stamps) as (done, ready), each (blocks, 5 n_layer):
    when each block finished each step's work, and when the next step's inputs had all reached it."""
    return stamps[:, 1:-1:2], stamps[:, 2:-1:2]


def megakernel_timeline(stamps):
    """Where a decode_megakernel step's time goes, from its trace: for each step of a layer (medians over the
    layers) the median and the slowest block's work (from its inputs' arrival to the step's last output) and
    wait (from there to the next step's inputs' arrival; step B polls its own, so A's wait is nil); then the
    head and the whole launch, in µs."""
    t = (stamps - stamps[:, 0].min()).double() / 1e3
    done, ready = megakernel_done_ready(t)
    work, wait = done - torch.cat([t[:, :1], ready[:, :-1]], 1), ready - done
    per_step = dict(work=work.median(0).values, slowest_work=work.max(0).values, wait=wait.median(0).values,
                    slowest_wait=wait.max(0).values)
    steps = {name: {k: v[i::len(MK_STEPS)].median().item() for k, v in per_step.items()}
             for i, name in enumerate(MK_STEPS)}
    head = (t[:, -1] - ready[:, -1]).max().item()
    return steps, head, (t[:, -1].max() - t[:, 0].min()).item()


@bench_rows("megakernel")
def bench_megakernel(rows, steps=100):
    """decode_megakernel at inference.py's default shape (gpt, 768 x 12, 8 heads, context 256), fp32 and bf16:
    its step alone (CUDA events over 100 launches from position 100, greedy pick not included), the weight
    bytes it reads over that time against the copy rate measured here, and the timeline of one step."""
    bw = inference.copy_bandwidth(DEV)
    print(f"\ndecode_megakernel, gpt 768 x 12, 8 heads, positions 100-199; copy rate {bw / 1e9:,.0f} GB/s")
    print(f"{'dtype':<6} {'us/step':>8} {'tok/s':>8} {'of copy bw':>11}   timeline of one step, us: steps of a layer "
          f"(median over layers): work of the median / slowest block, its wait for the next step's inputs")
    for dtype in ("fp32", "bf16"):
        model = inference.with_dtype(train.GPT(95, 256, 768, 8, 12, 0, train.TORCH_OPS).to(DEV).eval(), dtype)
        if why := inference.megakernel_why_not(model):
            print(f"{dtype}: {why}")
            return
        cache = inference.kv_cache(model, DEV)
        with torch.no_grad():
            model(torch.randint(0, 95, (1, 100), device=DEV), cache=cache)
            mk, tok, start = inference.Megakernel(model, cache), torch.tensor([[7]], device=DEV), cache.pos.clone()
            for _ in range(5):
                mk(tok)
            cache.pos.copy_(start)
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            for _ in range(steps):
                mk(tok)
            t1.record()
            t1.synchronize()
            cache.pos.copy_(start)
            trace = torch.zeros(kernels.decode_megakernel_trace_shape(len(model.blocks)), dtype=torch.long,
                                device=DEV)
            mk(tok, trace)
        kernels.check_errors()
        us = t0.elapsed_time(t1) * 1e3 / steps
        frac = inference.weight_bytes_per_token(model) / (us * 1e-6) / bw
        by_step, head, total = megakernel_timeline(trace.cpu())
        layer = " | ".join(f"{k} {v['work']:.1f}/{v['slowest_work']:.1f}, {v['wait']:.1f}/{v['slowest_wait']:.1f}"
                           for k, v in by_step.items())
        print(f"{dtype:<6} {us:>8.1f} {1e6 / us:>8,.0f} {frac:>11.0%}   {layer} | head {head:.1f} | traced step "
              f"{total:.1f}")
        rows.append(dict(op="decode_megakernel", shape="768x12", dtype=dtype, us=us, copy_fraction=frac,
                         timeline=by_step, head_us=head))


# ==== across the ops ====
# the op sets' names, opcheck of every dispatcher op, compiling and autocast across ops, NaN and inf
# through the row ops, bad indices in a CUDA graph; the benches of several ops or whole models


def op_sets_same_names():
    # the kernels module's ops are train.OP_NAMES, and both op sets expose them under the same names
    # (plus split, which is no kernel)
    # (set_pdl and set_attention_wgmma are launch settings, no ops; decode_megakernel and its helpers decode
    # a whole model, whose step on either op set is its twin: inference/gpu_megakernel_step)
    settings = ("set_pdl", "set_attention_wgmma")
    ours = sorted(n for n in dir(kernels) if not n.startswith("_") and callable(getattr(kernels, n))
                  and n not in settings and not n.startswith("decode_megakernel"))
    assert ours == train.OP_NAMES, f"kernels: {ours}\ntorch op set: {train.OP_NAMES}"
    cuda = train.cuda_op_set(kernels, 64)
    assert sorted(vars(cuda)) == sorted(vars(train.TORCH_OPS)), "cuda and torch op sets differ in names"
    return f"{len(ours)} ops: {', '.join(ours)}"


add("opsets/same_names", op_sets_same_names)


def t_opcheck(dt):
    done = []
    for name, op, args, kwargs in opcheck_cases(dt):
        try:
            torch.library.opcheck(op.default, args, kwargs, test_utils=OPCHECK_TESTS)
        except Exception as e:
            raise AssertionError(f"{name}: {one_line(e)}") from e
        done.append(name)
    return f"{len(done)} cases x {len(OPCHECK_TESTS)} checks: {', '.join(done)}"


def t_opcheck_covers_every_op():
    # every op registered as kernels::<name> has an opcheck case, in one dtype or the other (the
    # megakernel's where this GPU runs it)
    registered = {n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
                  if n.startswith("kernels::")}
    if not _megakernel_supported(torch.float32):
        registered.discard("decode_megakernel")
    checked = {op._qualified_op_name.split("::")[1]
               for dt in (torch.float32, BF16) for _, op, _, _ in opcheck_cases(dt)}
    assert registered <= checked, f"ops with no opcheck case: {sorted(registered - checked)}"
    return f"{len(registered)} ops registered, each with a case"


def t_compile_fullgraph(dt):
    # a pre-norm feed-forward of our ops, compiled whole; forward and gradients equal to eager's
    import torch._dynamo
    C = 64

    def block(x, y, w, b, wg):
        s, h = kernels.add_layernorm(x, y, w, b)
        h = kernels.swiglu(kernels.gelu(h, approximate="tanh"), kernels.silu(h * wg))
        return (s + kernels.rmsnorm(h, w)).float().pow(2).mean() + kernels.softmax(h, out_dtype=torch.float32).sum()

    leaves = [_leaf(3, 17, C, dtype=dt), _leaf(3, 17, C, dtype=dt), _leaf(C, dtype=dt), _leaf(C, dtype=dt),
              _leaf(C, dtype=dt)]
    explain = torch._dynamo.explain(block)(*leaves)
    assert explain.graph_break_count == 0, f"{explain.graph_break_count} graph breaks: {explain.break_reasons}"
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    eager_out, comp_out = block(*leaves), compiled(*leaves)
    eager_grads = torch.autograd.grad(eager_out, leaves)
    comp_grads = torch.autograd.grad(comp_out, leaves)
    tol = 1e-5 if dt == torch.float32 else 2e-2
    check("out", comp_out, eager_out, (tol, tol))
    for i, (g_c, g_e) in enumerate(zip(comp_grads, eager_grads)):
        check(f"d{i}", g_c, g_e, (tol, tol))
    return f"{explain.graph_count} graph, 0 breaks"


def t_autocast_policy():
    # torch.autocast(bfloat16) around our fp32 calls makes the bf16 policy's casts (bindings.cpp's autocast
    # section): outputs and gradients equal, bit for bit and dtype for dtype, to the same calls with those
    # casts written out. The cuda op set's --dtype=bf16 is this autocast around its fp32 op set.
    if torch.cuda.get_device_capability() != (9, 0):
        raise Skip("bf16 products run on Hopper's wgmma (compute capability 9.0)")
    k, bf, f32, C = kernels, BF16, torch.float32, 64

    def b16(t):
        return t.to(bf)
    qkv, qkv24 = [(2, 3, 17, 64)] * 3, [(2, 3, 17, 24)] * 3  # 24: a head size the fused kernels lack
    cases = (  # name, the call under autocast, the call with autocast's casts written out, leaf shapes
        # (float32 leaves, or (shape, dtype))
        ("linear", lambda x, w, b: k.linear(x, w, b), lambda x, w, b: k.linear(b16(x), w, b),
         [(5, 7, C), (48, C), (48,)]),
        ("matmul", k.matmul, lambda a, m: k.matmul(b16(a), b16(m)), [(37, C), (C, 24)]),
        ("layernorm", k.layernorm, lambda x, w, b: k.layernorm(x, w, b, out_dtype=bf), [(37, C), (C,), (C,)]),
        ("rmsnorm", k.rmsnorm, lambda x, w: k.rmsnorm(x, w, out_dtype=bf), [(37, C), (C,)]),
        ("add_layernorm", k.add_layernorm, lambda x, y, w, b: k.add_layernorm(x, y, w, b, out_dtype=bf),
         [(37, C), ((37, C), bf), (C,), (C,)]),  # y: a sublayer's output, bf16 under autocast
        ("add_rmsnorm", k.add_rmsnorm, lambda x, y, w: k.add_rmsnorm(x, y, w, out_dtype=bf),
         [(37, C), ((37, C), bf), (C,)]),
        ("softmax of bf16", lambda x: k.softmax(b16(x)), lambda x: k.softmax(b16(x), out_dtype=f32), [(37, C)]),
        ("attention fused", lambda q, kk, v: k.attention(q, kk, v, causal=True, mode="fused"),
         lambda q, kk, v: k.attention(b16(q), b16(kk), b16(v), causal=True, mode="fused"), qkv),
        ("attention tiled", lambda q, kk, v: k.attention(q, kk, v, causal=True, mode="tiled"),
         lambda q, kk, v: k.attention(q, kk, v, causal=True, mode="tiled").to(bf), qkv24),
        ("gelu, as called", k.gelu, k.gelu, [(37, C)]),
    )
    for name, under, written, shapes in cases:
        leaves = [_leaf(*s[0], dtype=s[1]) if isinstance(s[0], tuple) else _leaf(*s) for s in shapes]
        copies = [t.detach().clone().requires_grad_() for t in leaves]
        with torch.autocast("cuda", dtype=bf):
            got = outputs(under(*leaves))
        want = outputs(written(*copies))
        dys = [torch.randn_like(t) for _, t in want]
        for (label, g), (_, w) in zip(got, want, strict=True):
            assert g.dtype == w.dtype and torch.equal(g, w), f"{name} {label}: {g.dtype} vs {w.dtype}, or values differ"
        grads = torch.autograd.grad([t for _, t in got], leaves, dys)
        for i, (g, w) in enumerate(zip(grads, torch.autograd.grad([t for _, t in want], copies, dys))):
            assert g.dtype == w.dtype and torch.equal(g, w), f"{name} d{i}: {g.dtype} vs {w.dtype}, or values differ"
    return f"{len(cases)} calls: outputs and gradients bit-identical to the casts written out"


add("dispatcher/opcheck_covers_every_op", t_opcheck_covers_every_op)
add("dispatcher/autocast_policy", t_autocast_policy)
for _dt, _tag in ((torch.float32, "fp32"), (BF16, "bf16")):
    add(f"dispatcher/opcheck_{_tag}", t_opcheck, _dt)
    add(f"dispatcher/compile_fullgraph_{_tag}", t_compile_fullgraph, _dt)


@mutant("nonfinite_swallowed", "layernorm/nonfinite_37x768", "rmsnorm/nonfinite_37x768", "softmax/nonfinite_37x17",
        "cross_entropy/nonfinite_nan_inf_37x65", "cross_entropy/nonfinite_neg_inf_at_target_37x65")
def _nonfinite_swallowed():
    """The row ops' outputs with NaN and inf turned into numbers, as a kernel that clamped or skipped them would
    give."""
    with contextlib.ExitStack() as stack:
        for name in ("layernorm", "rmsnorm", "softmax", "cross_entropy"):
            op = getattr(kernels, name)
            stack.enter_context(unittest.mock.patch.object(
                kernels, name, lambda *args, _op=op, **kw: torch.nan_to_num(_op(*args, **kw))))
        yield


def bad_index_in_cuda_graph():
    # A captured embedding and cross_entropy, replayed with bad indices: the kernels record the error
    # inside the graph; the first one (in stream order) is the one reported, the later one is dropped.
    V, C, N = 10, 8, 4
    w, logits = rand(V, C), rand(N, V)
    idx, targets = torch.zeros(4, dtype=torch.long, device=DEV), torch.zeros(N, dtype=torch.long, device=DEV)

    def step():
        return kernels.embedding(idx, w), kernels.cross_entropy(logits, targets)

    side = torch.cuda.Stream()  # one eager call on a side stream first, as capture requires
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, loss = step()

    def replay(new_idx, new_targets):
        idx.copy_(torch.tensor(new_idx))
        targets.copy_(torch.tensor(new_targets))
        graph.replay()

    replay([1, 2, 12, 3], [0, 1, -3, 2])
    expect_index_error(kernels.check_errors, "embedding", "idx", 12, V)
    assert out[2].isnan().all() and torch.equal(out[[0, 1, 3]], w[[1, 2, 3]]), "embedding rows after replay"
    assert loss.isnan(), "cross-entropy with a bad target is not NaN"
    replay([1, 2, 9, 3], [0, 1, -3, 2])
    expect_index_error(kernels.check_errors, "cross_entropy", "targets", -3, V)
    replay([1, 2, 9, 3], [0, 1, 9, 2])
    kernels.check_errors()
    assert torch.equal(out, w[idx]) and loss.isfinite(), "replay with good indices"
    check("loss", loss, F.cross_entropy(logits.double(), targets), CE_TOL)
    return "first error of the replay reported, then none"


add("bad_index/cuda_graph_replay", bad_index_in_cuda_graph)


@bench_rows("overhead")
def bench_call_overhead(rows, calls=2000):
    """Microseconds an eager call of an op takes at a size where the launch is all of it (forward alone,
    and forward + backward with gradients wanted): what the Python-to-kernel path costs per call, ours
    against the twin's. One sync after all the calls, none inside."""
    print(f"\n{'call overhead':<34} {'ours us':>9} {'torch us':>9}")
    x, w, b = rand(4, 64), rand(64), rand(64)
    cases = (("gelu", lambda ops, x: ops.gelu(x), [x]), ("layernorm", lambda ops, x, w, b: ops.layernorm(x, w, b), [x, w, b]),
             ("linear", lambda ops, x, w: ops.linear(x, w), [x, rand(64, 64)]), ("softmax", lambda ops, x: ops.softmax(x), [x]))
    for name, f, inputs in cases:
        for grad in (False, True):
            leaves = [t.detach().requires_grad_(grad) for t in inputs]
            per_call = {}
            for side, ops in (("ours", kernels), ("torch", REF)):
                def once():
                    y = f(ops, *leaves)
                    if grad:
                        y.sum().backward()
                for _ in range(20):  # warm-up: library handles, the caching allocator
                    once()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(calls):
                    once()
                torch.cuda.synchronize()
                per_call[side] = 1e6 * (time.perf_counter() - t0) / calls
            what = f"{name} {'fwd+bwd' if grad else 'fwd'}"
            print(f"{what:<34} {per_call['ours']:>9.1f} {per_call['torch']:>9.1f}")
            rows.append(dict(op=name, shape="call overhead", direction="fwd+bwd" if grad else "fwd",
                             ours_us=per_call["ours"], torch_us=per_call["torch"]))


def mhc_step_kernels(variant, n_embd, n_head, block_size, batch_size, dtype="fp32", n_layer=4, steps=3):
    """Device time of each kernel of an eager training step (forward, backward, AdamW) of a GPT with this
    residual on the cuda op set, per sublayer: {kernel name: us}, read by torch.profiler over `steps` steps."""
    cfg = types.SimpleNamespace(**{**train.DEFAULTS, "weight_decay": 0.0})
    ops = train.cuda_op_set(kernels, n_embd // n_head, dtype)
    model = train.GPT(data.INCREMENT_VOCAB, block_size, n_embd, n_head, n_layer, 0, ops, residual=variant).to(DEV)
    opt = train.make_optimizer(model, cfg, True, False)
    x = torch.randint(0, data.INCREMENT_VOCAB, (batch_size, block_size + 1), device=DEV)
    step = functools.partial(train.train_step, model, opt, x[:, :-1].contiguous(), x[:, 1:].contiguous())
    for _ in range(2):  # optimizer state, library handles
        step()
    torch.cuda.synchronize()
    with warnings.catch_warnings():  # the profiler's note that it keeps one cycle's events: one cycle is all there is
        warnings.simplefilter("ignore", UserWarning)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
    kernels.check_errors()
    per = steps * 2 * n_layer  # sublayers timed
    return {e.key: e.self_device_time_total / per for e in prof.key_averages() if e.self_device_time_total > 0}


@bench_rows("mhc_profile")
def bench_mhc_profile(rows):
    """Where mhc-dynamic's extra training time goes, kernel by kernel: an eager step of a 4-layer model at the sweep's
    shape (256 wide, 32 x 128 tokens) and at 768 wide (16 x 256 tokens; fp32 and bf16), each kernel's device time a
    sublayer, the mHC kernels by name and the rest as one line against the baseline's (then its largest differences,
    kernel by kernel), beside the 15% of the baseline's step that a cost of 1.15x allows. The model's first hc_pre
    (no mix before it) and last stream_mix (its exit) count as an eighth each. Each mHC kernel's time is also given
    in passes, the time to read or write the fp32 streams once at the copy rate measured here: set beside the
    reads and writes a kernel's data flow needs, they show how near that rate it runs."""
    def short(name, width=56):  # a kernel's name without its arguments and PyTorch's namespaces
        return re.sub(r"^void |at::native::|\(anonymous namespace\)::|\(.*$", "", name)[:width]

    bw = inference.copy_bandwidth(DEV)
    for n_embd, n_head, block_size, batch_size, dtype in ((256, 4, 128, 32, "fp32"), (768, 8, 256, 16, "fp32"),
                                                          (768, 8, 256, 16, "bf16")):
        base = mhc_step_kernels("baseline", n_embd, n_head, block_size, batch_size, dtype)
        dyn = mhc_step_kernels("mhc-dynamic", n_embd, n_head, block_size, batch_size, dtype)
        ours = {k: v for k, v in dyn.items() if re.search(r"hc_|stream_|sinkhorn", k)}
        rest = sum(v for k, v in dyn.items() if k not in ours) - sum(base.values())
        b, d = sum(base.values()), sum(dyn.values())
        pass_us = batch_size * block_size * 4 * n_embd * 4 / bw * 1e6  # the streams: (tokens, 4, n_embd) fp32
        print(f"\nmhc-dynamic, {batch_size * block_size} tokens x {n_embd} wide, 4 streams, {dtype}: eager training "
              f"step, kernel time a sublayer: baseline {b:.1f} us, mhc-dynamic {d:.1f} us ({d / b:.2f}x); "
              f"extra {d - b:.1f} us where 1.15x allows {0.15 * b:.1f}; a pass over the streams: {pass_us:.1f} us "
              f"at the copy rate ({bw / 1e9:,.0f} GB/s)")
        for name, us in sorted(ours.items(), key=lambda kv: -kv[1]):
            print(f"  {short(name):<58} {us:>7.1f} {us / pass_us:>5.1f} passes")
            rows.append(dict(op="mhc_profile", shape=f"{n_embd}", dtype=dtype, kernel=short(name), us=us,
                             passes=us / pass_us))
        print(f"  {'the other kernels, against the baseline':<58} {rest:>+7.1f}; the largest differences:")
        others = (set(base) | set(dyn)) - set(ours)
        diffs = sorted(((dyn.get(k, 0.0) - base.get(k, 0.0), k) for k in others), key=lambda t: -abs(t[0]))
        for diff, name in diffs[:5]:
            print(f"    {short(name, 72):<72} {diff:>+7.1f}")
        rows.append(dict(op="mhc_profile", shape=f"{n_embd}", dtype=dtype, kernel="other", us=rest, baseline_us=b,
                         mhc_us=d))


@bench_rows("ddp")
def bench_ddp_scaling(rows, iters=200):
    """train.py --preset=large, both op sets, fp32 and bf16, on one GPU at twice the preset's batch and at
    the preset's batch, and through torchrun on two GPUs at the preset's batch a rank (the first run's
    global batch): tokens/s of each, the scaling against each one-GPU run, and the op sets' largest loss
    difference over the first 100 steps at the global batch, on one GPU and on two (results.json's)."""
    if torch.cuda.device_count() < 2:
        print(f"\nddp scaling: needs 2 GPUs, this machine has {torch.cuda.device_count()}")
        return
    b = train.PRESETS["large"]["batch_size"]
    print(f"\nddp scaling: --preset=large, {iters} steps; tok/s on 1 GPU at batch {2 * b} and {b}, on 2 GPUs at {b} a "
          f"rank;\nscaling: 2 GPUs over 1 GPU at {2 * b} (the same global batch) and at {b} (the same batch a GPU); "
          f"loss diff: the op sets' largest |difference| over 100 steps at global batch {2 * b}")
    print(f"{'dtype':<6} {'op set':<7} {f'1 GPU B{2 * b}':>12} {f'1 GPU B{b}':>12} {'2 GPUs':>12} {'scaling':>8} "
          f"{f'vs B{b}':>8} {'loss diff 1 GPU':>16} {'2 GPUs':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in ("fp32", "bf16"):
            common = ["--preset=large", f"--max_iters={iters}", f"--eval_interval={iters}", "--eval_iters=5",
                      "--sample_len=0", "--plot=false", f"--dtype={dtype}"]
            runs = {"one2": (_train_run, 2 * b), "one": (_train_run, b), "two": (_torchrun, b)}
            res = {}
            for name, (launch, batch) in runs.items():
                out = os.path.join(tmp, f"{dtype}_{name}")
                p = launch(*common, f"--out_dir={out}", f"--batch_size={batch}", timeout=900)
                if p.returncode:
                    print(f"{dtype} {name}: exit {p.returncode}\n{p.stderr[-1500:]}")
                    rows.append(dict(op="ddp", shape="large", dtype=dtype, check_ok=False))
                    break
                res[name] = json.load(open(os.path.join(out, "results.json")))
            else:
                bench_ddp_rows(rows, dtype, res)


def bench_ddp_rows(rows, dtype, res):
    """bench_ddp_scaling's rows for one dtype, from the three runs' results.json."""
    diff = {n: res[n]["max_abs_loss_diff_first_100"] for n in res}
    for ops in ("torch", "cuda"):
        tps = {n: res[n]["op_sets"][ops]["tokens_per_s"] for n in res}
        scaling, per_gpu = tps["two"] / tps["one2"], tps["two"] / tps["one"]
        print(f"{dtype:<6} {ops:<7} {tps['one2']:>12,.0f} {tps['one']:>12,.0f} {tps['two']:>12,.0f} {scaling:>7.2f}x "
              f"{per_gpu:>7.2f}x {diff['one2']:>16.2e} {diff['two']:>9.2e}", flush=True)
        rows.append(dict(op="ddp", shape="large", dtype=dtype, op_set=ops, tok_s=tps, scaling=scaling,
                         scaling_same_batch=per_gpu, loss_diff_one_gpu=diff["one2"], loss_diff_two_gpus=diff["two"]))


# ==== script tests: data.py (CPU) ====


BODY = ("The Wonderful Wizard of Oz\n\nby L. Frank Baum\n\n"
        "Dorothy lived in the midst of the great Kansas prairies.\n“Toto,” she said.")
SAMPLE = ("\ufeffThe Project Gutenberg eBook of The Wonderful Wizard of Oz\r\n"
          "This ebook is for the use of anyone anywhere.\r\n\r\n"
          "Title: The Wonderful Wizard of Oz\r\n\r\n"
          "*** START OF THE PROJECT GUTENBERG EBOOK THE WONDERFUL WIZARD OF OZ ***\r\n\r\n\r\n"
          + BODY.replace("\n", "\r\n") +
          "\r\n\r\n\r\n*** END OF THE PROJECT GUTENBERG EBOOK THE WONDERFUL WIZARD OF OZ ***\r\n\r\n"
          "Updated editions will replace the previous one.\r\nSTART: FULL LICENSE\r\n")
CLEAN = BODY + "\n"


def _serve(payloads):
    """Serve {path: bytes} on 127.0.0.1; other paths get 404. Returns (server, port, counter)."""
    counter = {"n": 0}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            counter["n"] += 1
            body = payloads.get(self.path)
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")  # no charset, as Gutenberg may do
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1], counter


def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def data_clean_text_gutenberg():
    out = data.clean_text(SAMPLE)
    assert out == CLEAN, f"cleaned sample differs from body:\n{out!r}\nvs\n{CLEAN!r}"
    assert "\r" not in out and "\ufeff" not in out, "CR or BOM left in cleaned text"
    lower = SAMPLE.replace("*** START OF THE", "*** start of this").replace("*** END OF THE", "*** End of This")
    assert data.clean_text(lower) == CLEAN, "THIS / lower-case markers not recognised"
    return f"gutenberg sample: {len(SAMPLE)} raw -> {len(out)} clean chars"


def data_clean_text_no_markers():
    raw = "\ufeffline one\r\nline two\rline three\n"
    out = data.clean_text(raw)
    assert out == "line one\nline two\nline three\n", f"unexpected cleaning: {out!r}"
    assert data.clean_text("abc") == "abc\n", "missing final newline not added"
    assert data.clean_text("abc\n\n\n") == "abc\n", "trailing newlines not collapsed to one"
    return "text without markers kept whole"


def data_download_and_cache():
    server, port, counter = _serve({"/pg55.txt": SAMPLE.encode("utf-8")})
    try:
        url = f"http://127.0.0.1:{port}/pg55.txt"
        with tempfile.TemporaryDirectory() as tmp:
            text = data.load_text(cache_dir=tmp, url=url, timeout=5)
            assert text == CLEAN, f"downloaded text differs from cleaned body: {text!r}"
            cache = os.path.join(tmp, data.CACHE_NAME)
            assert os.path.isfile(cache), f"cache file not written: {cache}"
            with open(cache, encoding="utf-8", newline="") as f:
                assert f.read() == CLEAN, "cache file content differs from cleaned body"
            assert os.listdir(tmp) == [data.CACHE_NAME], f"stray files in cache: {os.listdir(tmp)}"
            assert counter["n"] == 1, f"expected 1 request, got {counter['n']}"
            again = data.load_text(cache_dir=tmp, url=url, timeout=5)
            assert again == text, "second load returned different text"
            assert counter["n"] == 1, f"second load hit the network ({counter['n']} requests)"
    finally:
        server.shutdown()
        server.server_close()
    return f"downloaded {len(text)} chars once, then served from cache"


def data_offline_error():
    url = f"http://127.0.0.1:{_free_port()}/pg55.txt"
    with tempfile.TemporaryDirectory() as tmp:
        cache = os.path.join(tmp, data.CACHE_NAME)
        try:
            data.load_text(cache_dir=tmp, url=url, timeout=2)
        except RuntimeError as e:
            msg = str(e)
            assert cache in msg, f"message does not name the cache path: {msg}"
            assert "--data_path" in msg, f"message does not mention --data_path: {msg}"
            assert url in msg, f"message does not name the URL: {msg}"
            assert e.__cause__ is not None, "original exception not chained"
            assert len(msg) < len(url) + len(cache) + 200, f"message too long: {msg}"
        else:
            raise AssertionError("no RuntimeError without a server")
        assert not os.path.exists(cache), "cache written despite failed download"
    return f"offline: {msg[:msg.index(')') + 1]}"


def data_http_404():
    server, port, counter = _serve({})
    try:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                data.load_text(cache_dir=tmp, url=f"http://127.0.0.1:{port}/missing.txt", timeout=2)
            except RuntimeError as e:
                assert "404" in str(e), f"404 not mentioned: {e}"
                assert os.path.join(tmp, data.CACHE_NAME) in str(e), f"cache path missing: {e}"
            else:
                raise AssertionError("no RuntimeError on HTTP 404")
            assert os.listdir(tmp) == [], f"files left after 404: {os.listdir(tmp)}"
    finally:
        server.shutdown()
        server.server_close()
    assert counter["n"] == 1, f"expected 1 request, got {counter['n']}"
    return "HTTP 404 -> RuntimeError"


def data_data_path():
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "book.txt")
        with open(path, "wb") as f:
            f.write(SAMPLE.encode("utf-8"))
        text = data.load_text(data_path=path, cache_dir=os.path.join(tmp, "cache"), url="http://127.0.0.1:1/x")
        assert text == CLEAN, f"data_path text not cleaned: {text!r}"
        assert not os.path.exists(os.path.join(tmp, "cache")), "data_path load touched the cache"
        missing = os.path.join(tmp, "nope.txt")
        try:
            data.load_text(data_path=missing)
        except FileNotFoundError as e:
            assert missing in str(e), f"missing path not named: {e}"
        else:
            raise AssertionError("no FileNotFoundError for a missing data_path")
        empty = os.path.join(tmp, "empty.txt")
        with open(empty, "w", encoding="utf-8") as f:
            f.write("\ufeff \r\n\r\n")
        try:
            data.load_text(data_path=empty)
        except ValueError as e:
            assert empty in str(e), f"empty path not named: {e}"
        else:
            raise AssertionError("no ValueError for an empty data_path")
    return f"data_path: {len(text)} chars; missing and empty files rejected"


def data_cache_cleaned():
    # A book put into the cache by hand, BOM, CRLF, Gutenberg header and all (as the README suggests
    # for offline use), gives the same text and vocabulary as the same file through --data_path.
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, data.CACHE_NAME), "wb") as f:
            f.write(SAMPLE.encode("utf-8"))
        cached = data.load_text(cache_dir=tmp, url="http://127.0.0.1:1/unused")
        via_path = data.load_text(data_path=os.path.join(tmp, data.CACHE_NAME))
    assert cached == CLEAN, f"cached book not cleaned: {cached!r}"
    assert cached == via_path, "cache and --data_path give different texts"
    return f"raw cache file -> {len(cached)} clean chars, vocab {len(set(cached))} either way"


def data_bad_files():
    with tempfile.TemporaryDirectory() as tmp:
        binary = os.path.join(tmp, "program")
        with open(binary, "wb") as f:
            f.write(b"\x7fELF\x02\x01\x01\x00" + bytes(range(128, 256)))  # like /bin/ls: not UTF-8
        for path, words in ((binary, ("not UTF-8", binary, "offset 8")), (tmp, ("directory", tmp))):
            try:
                data.load_text(data_path=path)
            except (OSError, ValueError) as e:
                assert all(w in str(e) for w in words), f"expected {words} in: {e}"
                assert "not found" not in str(e), f"a directory reported as missing: {e}"
            else:
                raise AssertionError(f"no error for data_path={path}")
        cache_dir = os.path.join(tmp, "cache")
        os.makedirs(cache_dir)
        os.rename(binary, os.path.join(cache_dir, data.CACHE_NAME))
        try:
            data.load_text(cache_dir=cache_dir, url="http://127.0.0.1:1/unused")
        except ValueError as e:
            assert "not UTF-8" in str(e) and os.path.join(cache_dir, data.CACHE_NAME) in str(e), str(e)
        else:
            raise AssertionError("no error for a cached book that is not UTF-8")
    return "binary file, directory and binary cache named in their errors"


def data_real_book():
    # The book as a newcomer places it for offline use (CI copies it there when it has a copy).
    path = os.path.join(data.CACHE_DIR, data.CACHE_NAME)
    if not os.path.isfile(path):
        raise Skip(f"data_cache/{data.CACHE_NAME} not present: put the book there to test the real text")
    text = data.load_text()
    assert text == data.load_text(data_path=path), "cache and --data_path give different texts"
    prefix = "The Wonderful Wizard of Oz\n\nby L. Frank Baum\n"
    assert text.startswith(prefix), f"unexpected start: {text[:60]!r}"
    assert "\r" not in text and "\ufeff" not in text, "CR or BOM left in the book"
    assert abs(len(text) - 207_802) <= 5, f"book length {len(text)} far from 207,802"
    assert text.endswith("glad to be at home again!”\n"), f"unexpected end: {text[-40:]!r}"
    return f"real book: {len(text):,} chars, {len(set(text))} distinct"


def data_tokenizer():
    text = "hello, Oz! “Toto”\n"
    tok = data.CharTokenizer(text)
    assert tok.vocab_size == len(set(text)), f"vocab_size {tok.vocab_size} != {len(set(text))}"
    ids = tok.encode(text)
    assert all(isinstance(i, int) for i in ids) and len(ids) == len(text), "encode output malformed"
    assert tok.decode(ids) == text, "round trip failed"
    assert tok.decode(torch.tensor(ids)) == text, "decode of a tensor failed"
    d = tok.to_dict()
    assert d == {"chars": "".join(sorted(set(text)))}, f"to_dict unexpected: {d}"
    tok2 = data.CharTokenizer.from_dict(d)
    assert tok2.encode(text) == ids and tok2.vocab_size == tok.vocab_size, "from_dict changed encoding"
    odd = data.CharTokenizer.from_dict({"chars": "zyx"})
    assert odd.encode("xyz") == [2, 1, 0], "from_dict re-sorted the characters"
    try:
        tok.encode("hello Q")
    except ValueError as e:
        assert "'Q'" in str(e) and "training text" in str(e), f"unhelpful message: {e}"
    else:
        raise AssertionError("unknown character did not raise ValueError")
    return f"tokens round trip: {len(text)} chars ok, vocab {tok.vocab_size}"


def data_split():
    ids = torch.arange(1000, dtype=torch.long)
    train, val = data.split_data(ids)
    assert len(train) == 900 and len(val) == 100, f"sizes {len(train)}/{len(val)}"
    assert torch.equal(torch.cat([train, val]), ids), "split is not contiguous and ordered"
    try:
        data.split_data(torch.arange(5))
    except ValueError as e:
        assert "5" in str(e), f"token count not in message: {e}"
    else:
        raise AssertionError("no ValueError for 5 tokens")
    return "split 1000 -> 900/100"


def data_get_batch():
    d = torch.arange(500, dtype=torch.long) * 7
    B, T = 8, 16
    x, y = data.get_batch(d, B, T, torch.Generator().manual_seed(0))
    assert x.shape == (B, T) and y.shape == (B, T), f"shapes {x.shape} {y.shape}"
    assert x.dtype == torch.int64 and y.dtype == torch.int64, f"dtypes {x.dtype} {y.dtype}"
    for row_x, row_y in zip(x, y):
        i = int(row_x[0]) // 7
        assert torch.equal(row_x, d[i:i + T]) and torch.equal(row_y, d[i + 1:i + 1 + T]), "y is not x shifted"
    x2, y2 = data.get_batch(d, B, T, torch.Generator().manual_seed(0))
    assert torch.equal(x, x2) and torch.equal(y, y2), "same seed gave different batches"
    x3, _ = data.get_batch(d, B, T, torch.Generator().manual_seed(1))
    assert not torch.equal(x, x3), "different seeds gave the same batch"
    xe, ye = data.get_batch(torch.arange(T + 1), 4, T, torch.Generator().manual_seed(0))
    assert torch.equal(xe[0], torch.arange(T)) and torch.equal(ye[0], torch.arange(1, T + 1)), "edge window wrong"
    for n in (T, T - 1):
        try:
            data.get_batch(torch.arange(n), B, T, torch.Generator())
        except ValueError as e:
            assert str(n) in str(e) and "block_size" in str(e), f"unhelpful message: {e}"
        else:
            raise AssertionError(f"no ValueError for {n} tokens with block_size {T}")
    # torchrun's ranks: rank r of 2 at batch B/2 holds rows r*B/2.. of the one-process batch B
    parts = [data.get_batch(d, B // 2, T, torch.Generator().manual_seed(0), rank=r, world=2)[0] for r in (0, 1)]
    assert torch.equal(torch.cat(parts), x), "the ranks' rows are not the one-process batch"
    return f"batches ({B}, {T}) int64, shifted, seeded, split over ranks"


# out_dir_lock under contention. The runs are forked from this process, so a fault planted here reaches them,
# and events order their steps so that the interleaving that gave two holders before happens in every round.

_FORK = multiprocessing.get_context("fork")


def _lock_contender(out_dir, mine, other, start, results):
    """One run taking out_dir's lock once start is set. Once it holds the lock, before its pid is written
    (data.lock_taken), it waits until the other run has tried: failed, or got that far itself. Puts
    ("held", pid) or ("refused", message) into results."""
    def pause(path):
        mine.set()
        other.wait(10)

    def fail(msg):
        mine.set()
        raise SystemExit(msg)

    data.lock_taken = pause  # this forked process only
    start.wait(10)
    try:
        with data.out_dir_lock(out_dir, "train.py", fail):
            results.put(("held", os.getpid()))
    except SystemExit as e:
        results.put(("refused", str(e)))


def _lock_race(out_dir, dead_pid=None):
    """One race of two runs for out_dir's lock: the verdicts of both. The second run starts while the first
    holds the lock and has not written its pid; given dead_pid, the lock file holds that process id (one that
    has ended) and both start at once."""
    lock, stale = os.path.join(out_dir, ".train.lock"), dead_pid is not None
    first, second, go, results = _FORK.Event(), _FORK.Event(), _FORK.Event(), _FORK.SimpleQueue()
    if stale:
        with open(lock, "w") as f:
            f.write(str(dead_pid))
    runs = [_FORK.Process(target=_lock_contender, args=(out_dir, first, second, go, results)),
            _FORK.Process(target=_lock_contender, args=(out_dir, second, first, go if stale else first, results))]
    for p in runs:
        p.start()
    go.set()
    for p in runs:
        p.join(20)
    hung = [p.pid for p in runs if p.is_alive()]
    for p in runs:
        p.kill()
        p.join()
    assert not hung, f"processes {hung} did not finish"
    assert all(p.exitcode == 0 for p in runs), f"exit codes {[p.exitcode for p in runs]}"
    verdicts = [results.get() for _ in runs]
    assert not os.path.exists(lock), f"the lock file outlived both runs ({verdicts})"
    return verdicts


def data_out_dir_lock_races(rounds=50):
    with tempfile.TemporaryDirectory() as tmp:
        ended = _FORK.Process(target=lambda: None)
        ended.start()
        ended.join()
        for dead_pid in (None, ended.pid):  # ended.pid: reaped, no process has that id now
            for r in range(rounds):
                verdicts = _lock_race(tmp, dead_pid)
                held = [v for v in verdicts if v[0] == "held"]
                assert len(held) == 1, f"{'stale ' * bool(dead_pid)}race {r + 1}: {len(held)} holders: {verdicts}"
                refused = next(msg for kind, msg in verdicts if kind == "refused")
                assert f"--out_dir={tmp} is in use by another train.py run" in refused, refused
    return f"{rounds}/{rounds} races: one holder; {rounds}/{rounds} over a dead run's lock: one holder"


def data_out_dir_lock_replaced_file():
    # A run that opened the lock file just before its holder ended and unlinked it, with a third run's new
    # file at the path by the time it locks, holds a file no other run will open: it must lock the new one.
    with tempfile.TemporaryDirectory() as tmp:
        lock, real_flock = os.path.join(tmp, ".train.lock"), fcntl.flock

        def replaced_first(fd, op):
            if not replaced_first.done:
                replaced_first.done = True
                os.remove(lock)
                open(lock, "w").close()
            real_flock(fd, op)
        replaced_first.done = False

        with unittest.mock.patch.object(fcntl, "flock", replaced_first), data.out_dir_lock(tmp, "train.py", sys.exit):
            with open(lock) as f:
                assert f.read() == str(os.getpid()), "the file at the path is not the holder's"
            try:
                with data.out_dir_lock(tmp, "train.py", sys.exit):  # another open file: flock refuses it too
                    raise AssertionError("a second run took the lock while the first held it")
            except SystemExit as e:
                assert f"process {os.getpid()}" in str(e), str(e)
    return "locked the file now at the path; a second try refused"


@mutant("out_dir_lock_keeps_an_unlinked_file", "data/out_dir_lock_replaced_file")
def _lock_keeps_unlinked_file():
    """out_dir_lock without its check that the file it locked is still the one at the path."""
    with unittest.mock.patch.object(os.path, "samestat", lambda a, b: True):
        yield


@contextlib.contextmanager
def _planted_lock(lock):
    """out_dir_lock replaced by lock where train.py and the tests call it."""
    with unittest.mock.patch.object(data, "out_dir_lock", lock), unittest.mock.patch.object(train, "out_dir_lock", lock):
        yield


@mutant("out_dir_lock_create_then_write", "data/out_dir_lock_races")
def _lock_create_then_write():
    """The lock as it was: the file created empty with O_EXCL and the pid written after, and a file naming no
    live process removed and created again. A run reading the empty file in between took the lock too."""
    def alive(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True

    @contextlib.contextmanager
    def create_then_write(out_dir, script, fail):
        path = os.path.join(out_dir, f".{script.removesuffix('.py')}.lock")
        while True:
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                break
            except FileExistsError:
                try:
                    with open(path) as f:
                        pid = int(f.read().strip() or 0)
                except (OSError, ValueError):
                    pid = 0
                if pid and pid != os.getpid() and alive(pid):
                    fail(f"--out_dir={out_dir} is in use by another {script} run (process {pid}); wait for it "
                         f"to end or pass another --out_dir")
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
        data.lock_taken(path)
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        try:
            yield
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)

    with _planted_lock(create_then_write):
        yield


for _fn in (data_clean_text_gutenberg, data_clean_text_no_markers, data_download_and_cache,
            data_offline_error, data_http_404, data_data_path, data_cache_cleaned, data_bad_files, data_real_book,
            data_tokenizer, data_split, data_get_batch, data_out_dir_lock_races,
            data_out_dir_lock_replaced_file):
    add(_fn.__name__.replace("_", "/", 1), _fn, gpu=False)


# ==== script tests: train.py on the CPU ====
# a one-layer, 32-wide model on a small generated text, a few seconds per run.


_TRAIN_TINY = ["--device=cpu", "--eval_interval=3", "--eval_iters=2", "--log_interval=2", "--batch_size=4",
               "--block_size=16", "--n_embd=32", "--n_head=2", "--n_layer=1", "--sample_len=20", "--plot=false"]


def _train_text_file(folder):
    """A few thousand characters of varied words, so every split is longer than block_size."""
    g = torch.Generator().manual_seed(0)
    words = ["the", "scarecrow", "tin", "woodman", "lion", "dorothy", "road", "of", "yellow", "brick", "and", "oz"]
    picks = torch.randint(0, len(words), (800,), generator=g).tolist()
    text = "".join(words[i] + (".\n" if k % 11 == 10 else " ") for k, i in enumerate(picks))
    path = os.path.join(folder, "tiny.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def _train_run(*args, timeout=120):
    return subprocess.run([sys.executable, "train.py", *args], cwd=HERE, capture_output=True, text=True,
                          timeout=timeout)


def _train_check_ok(proc, what):
    # stderr first: the runner prints a failure's first 400 characters
    assert proc.returncode == 0, f"{what}: exit {proc.returncode}\n{proc.stderr[-2000:]}\n{proc.stdout[-2000:]}"


def _train_load_ckpt(path):
    assert os.path.isfile(path), f"no checkpoint at {path}"
    return torch.load(path, map_location="cpu", weights_only=False)


def train_cpu_checkpoint_and_resume():
    with tempfile.TemporaryDirectory() as tmp:
        text = _train_text_file(tmp)
        out = os.path.join(tmp, "out")
        p = _train_run(*_TRAIN_TINY, f"--data_path={text}", f"--out_dir={out}", "--max_iters=6")  # the script itself
        _train_check_ok(p, "train.py --device=cpu")
        assert "PyTorch op set only" in p.stdout, f"no torch-only note in:\n{p.stdout}"
        assert "iter 6/6" in p.stdout and "val" in p.stdout, f"no log/eval lines in:\n{p.stdout}"
        ck = _train_load_ckpt(os.path.join(out, "ckpt_torch.pt"))
        for key in ("config", "vocab", "model", "optimizer", "iter", "train_loss", "evals", "batch_rng"):
            assert key in ck, f"checkpoint lacks {key!r}"
        assert ck["iter"] == 6 and len(ck["train_loss"]) == 6, (ck["iter"], len(ck["train_loss"]))
        assert [e["iter"] for e in ck["evals"]] == [3, 6], ck["evals"]
        assert os.path.isfile(os.path.join(out, "results.json")), "no results.json"
        assert not [f for f in os.listdir(out) if ".tmp" in f], f"temp files left in {os.listdir(out)}"

        # The resume and the run it is compared with in this process, where --mutants reaches them.
        log = _train_main_ok(*_TRAIN_TINY, f"--data_path={text}", f"--out_dir={out}", "--max_iters=8", "--resume=true")
        assert "resuming from iteration 6" in log, f"no resume line in:\n{log}"
        resumed = _train_load_ckpt(os.path.join(out, "ckpt_torch.pt"))
        assert resumed["iter"] == 8 and len(resumed["train_loss"]) == 8, (resumed["iter"], len(resumed["train_loss"]))
        assert resumed["train_loss"][:6] == ck["train_loss"], "resume rewrote the loss history"

        # Weights, optimizer state and batch order all restored: 6 + 2 steps equal 8 steps in one go.
        out8 = os.path.join(tmp, "out8")
        _train_main_ok(*_TRAIN_TINY, f"--data_path={text}", f"--out_dir={out8}", "--max_iters=8")
        straight = _train_load_ckpt(os.path.join(out8, "ckpt_torch.pt"))
        worst = max(abs(a - b) for a, b in zip(straight["train_loss"], resumed["train_loss"]))
        assert worst < 1e-5, f"resumed losses differ from an uninterrupted run by {worst:.2e}"
    return f"6 + 2 resumed steps against 8 in one go: max |loss diff| {worst:.1e}"


@mutant("resume_skips_optimizer_state", "train/cpu_checkpoint_and_resume")
def _resume_without_optimizer_state():
    """--resume=true restores the weights and the batches, but AdamW starts afresh (no moments, step 0)."""
    with unittest.mock.patch.object(torch.optim.Optimizer, "load_state_dict", lambda self, state_dict: None):
        yield


@mutant("resume_skips_batch_rng_state", "train/cpu_checkpoint_and_resume")
def _resume_without_batch_rng():
    """--resume=true restores the weights and the optimizer, but draws the batches from the seed again."""
    real = data.load_checkpoint

    def load(path, cfg, tok, model, opt, batch_gen, fail):
        return real(path, cfg, tok, model, opt, torch.Generator(), fail)  # the state goes to a throwaway
    with unittest.mock.patch.object(train, "load_checkpoint", load):
        yield


def train_cpu_dropout_resume():
    # --dropout: 6 steps, a resume to 8, against 8 in one go: a step's masks come from the rng offset, which
    # the checkpoint carries; the offset counts the steps; the masks change the losses (against no dropout)
    tiny = [*_TRAIN_TINY, "--n_layer=2"]
    with tempfile.TemporaryDirectory() as tmp:
        text = _train_text_file(tmp)
        out, out8, plain = (os.path.join(tmp, d) for d in ("out", "out8", "plain"))
        _train_main_ok(*tiny, f"--data_path={text}", f"--out_dir={out}", "--max_iters=6", "--dropout=0.3")
        ck = _train_load_ckpt(os.path.join(out, "ckpt_torch.pt"))
        assert ck["dropout_rng"].tolist() == [train.DEFAULTS["seed"], 6], f"dropout rng {ck['dropout_rng'].tolist()}"
        _train_main_ok(*tiny, f"--data_path={text}", f"--out_dir={out}", "--max_iters=8", "--dropout=0.3",
                       "--resume=true")
        resumed = _train_load_ckpt(os.path.join(out, "ckpt_torch.pt"))
        _train_main_ok(*tiny, f"--data_path={text}", f"--out_dir={out8}", "--max_iters=8", "--dropout=0.3")
        straight = _train_load_ckpt(os.path.join(out8, "ckpt_torch.pt"))
        _train_main_ok(*tiny, f"--data_path={text}", f"--out_dir={plain}", "--max_iters=8")
        without = _train_load_ckpt(os.path.join(plain, "ckpt_torch.pt"))
    worst = max(abs(a - b) for a, b in zip(straight["train_loss"], resumed["train_loss"]))
    assert worst < 1e-6, f"resumed losses differ from an uninterrupted run's by {worst:.2e}"
    moved = max(abs(a - b) for a, b in zip(straight["train_loss"], without["train_loss"]))
    assert moved > 1e-3, f"--dropout=0.3 changed the losses by {moved:.1e} only"
    assert "dropout_rng" not in without, "a run without dropout saved a dropout rng"
    return f"6 + 2 resumed steps against 8 in one go: max |loss diff| {worst:.1e}; {moved:.2f} from no dropout"


@mutant("resume_skips_dropout_rng", "train/cpu_dropout_resume")
def _resume_skips_dropout_rng():
    """--resume=true restores everything but dropout's offset, which starts from 0 again."""
    real = data.load_checkpoint

    def load(path, cfg, tok, model, opt, batch_gen, fail):
        rng = model.dropout_rng.clone()
        out = real(path, cfg, tok, model, opt, batch_gen, fail)
        model.dropout_rng.copy_(rng)
        return out
    with unittest.mock.patch.object(train, "load_checkpoint", load):
        yield


def train_cpu_dropout_off_in_eval():
    # evaluation and sampling see no dropout: a model with dropout 0.5 evaluates and samples as the same
    # weights without it, and its training-mode forward draws the same masks twice for one offset
    cfg = types.SimpleNamespace(**{**train.DEFAULTS, "device": "cpu", "n_layer": 2, "n_embd": 32, "n_head": 2,
                                   "block_size": 16, "batch_size": 4, "eval_iters": 2, "sample_len": 12})
    with_drop = train.model_from_config(cfg, 20, train.TORCH_OPS, dropout=0.5)
    without = train.model_from_config(cfg, 20, train.TORCH_OPS)
    ids = torch.randint(0, 20, (400,), generator=torch.Generator().manual_seed(0))
    splits = {"train": ids[:300], "val": ids[300:]}
    a, b = train.estimate_loss(with_drop, splits, cfg), train.estimate_loss(without, splits, cfg)
    assert a == b, f"evaluation with dropout 0.5: {a}, without: {b}"
    tok = data.CharTokenizer("abcdefghijklmnopqrs\n")
    sa, sb = train.generate(with_drop, tok, cfg, "cpu"), train.generate(without, tok, cfg, "cpu")
    assert sa == sb, f"samples differ: {sa!r} and {sb!r}"
    assert with_drop.training, "evaluation left the model in eval mode"
    x = ids[:64].view(4, 16)
    l1, l2 = with_drop(x, x)[1], with_drop(x, x)[1]
    with_drop.next_dropout_masks()
    l3 = with_drop(x, x)[1]
    assert l1 == l2 != l3, f"training-mode losses {l1.item()}, {l2.item()}, after the next masks {l3.item()}"
    with_drop.dropout_stream = 1  # torchrun's rank 1: masks of its own at the same offset
    l4 = with_drop(x, x)[1]
    assert l4 != l3, f"rank 1 drew rank 0's masks: loss {l4.item()}"
    return f"eval losses {a}; training-mode loss {l1.item():.4f}, next masks {l3.item():.4f}, rank 1's {l4.item():.4f}"


@mutant("ranks_draw_one_mask", "train/cpu_dropout_off_in_eval")
def _ranks_draw_one_mask():
    # every torchrun rank draws rank 0's masks
    real = train.Dropout.__init__
    with unittest.mock.patch.object(train.Dropout, "__init__",
                                    lambda self, ops, p, rng, stream=0: real(self, ops, p, rng, 0)):
        yield


@mutant("evaluation_with_dropout", "train/cpu_dropout_off_in_eval")
def _evaluation_with_dropout():
    with unittest.mock.patch.object(train, "evaluating", lambda model: contextlib.nullcontext()):
        yield


def train_lr_schedule():
    # lr_at at the large preset's schedule (lr 1e-3, 100 warm-up steps, cosine to 1e-4 at 800), against nanoGPT's
    # formula worked by hand: the warm-up's first and last steps, the peak, the cosine's quarter and middle, the
    # last step and min_lr at max_iters; rising then falling; the constant schedule's --lr at any step
    cfg = types.SimpleNamespace(**{**train.DEFAULTS, **train.PRESETS["large"]})
    schedule = (cfg.lr, cfg.lr_schedule, cfg.warmup_iters, cfg.min_lr, cfg.max_iters)
    assert schedule == (1e-3, "cosine", 100, 1e-4, 800), f"the large preset's schedule: {schedule}"
    want = {0: 1e-3 / 101, 99: 1e-3 * 100 / 101, 100: 1e-3, 275: 1e-4 + 0.5 * (1 + math.sqrt(0.5)) * 9e-4,
            450: 5.5e-4, 799: 1e-4 + 0.5 * (1 + math.cos(math.pi * 699 / 700)) * 9e-4, 800: 1e-4}
    bad = {it: (train.lr_at(cfg, it), w) for it, w in want.items() if not math.isclose(train.lr_at(cfg, it), w,
                                                                                        rel_tol=1e-12)}
    assert not bad, f"lr_at(it): (got, want) {bad}"
    lrs = [train.lr_at(cfg, it) for it in range(cfg.max_iters + 1)]
    assert all(a < b for a, b in zip(lrs[:100], lrs[1:101])), "the warm-up does not rise at every step"
    assert all(a > b for a, b in zip(lrs[100:], lrs[101:])), "the cosine does not fall at every step"
    const = types.SimpleNamespace(**train.DEFAULTS)
    got = {it: train.lr_at(const, it) for it in (0, 1, 500, const.max_iters)}
    assert const.lr_schedule == "constant" and set(got.values()) == {const.lr}, f"constant: {got}"
    with contextlib.redirect_stdout(io.StringIO()):  # --max_iters=0 (evaluate the untrained model) runs no step
        assert train.parse_config(["--preset=large", "--max_iters=0"]).max_iters == 0
    return f"{len(want)} points within 1e-12, up then down over {len(lrs)} steps; constant {const.lr:g}"


@mutant("cosine_ignores_min_lr", "train/lr_schedule")
def _cosine_ignores_min_lr():
    # the cosine decays to 0, not to --min_lr
    real = train.lr_at
    with unittest.mock.patch.object(train, "lr_at",
                                    lambda cfg, it: real(types.SimpleNamespace(**{**vars(cfg), "min_lr": 0.0}), it)):
        yield


@contextlib.contextmanager
def _lr_seen(seen, interrupt_after=None):
    """Each AdamW step of the runs within appends its param groups' lr to seen (train.make_optimizer patched).
    interrupt_after: a SIGINT to this process in that step, as Ctrl-C mid-run (the run stops after it)."""
    real = train.make_optimizer

    def make(*args, **kwargs):
        opt = real(*args, **kwargs)
        opt.register_step_pre_hook(lambda opt, a, kw: seen.append([float(g["lr"]) for g in opt.param_groups]))
        if interrupt_after:
            opt.register_step_post_hook(
                lambda opt, a, kw: signal.raise_signal(signal.SIGINT) if len(seen) == interrupt_after else None)
        return opt
    with unittest.mock.patch.object(train, "make_optimizer", make):
        yield


def train_cpu_lr_schedule_resume():
    # --lr_schedule=cosine: every AdamW step of 8 sees lr_at of its iteration in both param groups; a run stopped by
    # Ctrl-C after step 5 and resumed goes on from iteration 5's lr, and its losses equal the uninterrupted run's
    sched = ("--lr_schedule=cosine", "--lr=1e-2", "--warmup_iters=2", "--min_lr=1e-3", "--max_iters=8")
    cfg = train.parse_config(list(sched))
    want = [[train.lr_at(cfg, it)] * 2 for it in range(8)]  # both param groups', before the runs patch anything
    straight_lrs, cut_lrs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        one, two = (os.path.join(tmp, d) for d in ("straight", "cut"))
        for folder in (one, two):
            os.makedirs(folder)
        with _lr_seen(straight_lrs):
            _train_main_ok(*_train_tiny_args(one, *sched))
        straight = _train_load_ckpt(os.path.join(one, "out", "ckpt_torch.pt"))
        with _lr_seen(cut_lrs, interrupt_after=5):
            code, out = _train_main(*_train_tiny_args(two, *sched))
        assert code == data.signal_exit(signal.SIGINT) and "after iteration 5" in out, f"exit {code!r}\n{out[-1500:]}"
        with _lr_seen(cut_lrs):
            log = _train_main_ok(*_train_tiny_args(two, *sched, "--resume=true"))
        assert "resuming from iteration 5" in log, f"no resume line in:\n{log}"
        resumed = _train_load_ckpt(os.path.join(two, "out", "ckpt_torch.pt"))
    assert straight_lrs == want, f"the uninterrupted run's steps saw lr {straight_lrs}, lr_at gives {want}"
    assert cut_lrs == want, f"the stopped and resumed run's steps saw lr {cut_lrs}, lr_at gives {want}"
    assert resumed["train_loss"] == straight["train_loss"], \
        f"resumed losses {resumed['train_loss']}, uninterrupted {straight['train_loss']}"
    return (f"lr {want[0][0]:.2e} -> {max(w[0] for w in want):.2e} -> {want[-1][0]:.2e} in 8 steps, 5 + 3 resumed: "
            f"losses bit-equal")


@mutant("lr_update_skipped", "train/cpu_lr_schedule_resume", "train/gpu_op_sets_agree_cosine_lr")
def _lr_update_skipped():
    # every step trains at the lr AdamW was built with: the schedule frozen at --lr
    with unittest.mock.patch.object(train, "set_lr", lambda opt, lr: None):
        yield


@mutant("lr_schedule_restarts_on_resume", "train/cpu_lr_schedule_resume")
def _lr_schedule_restarts_on_resume():
    # a resumed run's schedule counts from the resume (warm-up again), not from the run's first step
    real_resume, real_lr_at, start = train.OpSetRun.resume, train.lr_at, [0]

    def resume(self):
        real_resume(self)
        start[0] = self.start
    with unittest.mock.patch.object(train.OpSetRun, "resume", resume), \
            unittest.mock.patch.object(train, "lr_at", lambda cfg, it: real_lr_at(cfg, it - start[0])):
        yield


def train_rejects_unknown_key():
    p = _train_run("--bogus=1")
    assert p.returncode != 0, "--bogus=1 was accepted"
    assert "bogus" in p.stderr and "max_iters" in p.stderr and "batch_size" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr, p.stderr


def train_rejects_bad_type():
    p = _train_run("--max_iters=abc")
    assert p.returncode != 0, "--max_iters=abc was accepted"
    assert "max_iters" in p.stderr and "int" in p.stderr and "abc" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    p = _train_run("--plot=maybe")
    assert p.returncode != 0 and "plot" in p.stderr and "Traceback" not in p.stderr, p.stderr


def train_cuda_backend_on_cpu_errors():
    p = _train_run("--backend=cuda", "--device=cpu")
    assert p.returncode != 0, "--backend=cuda --device=cpu was accepted"
    assert "backend=cuda" in p.stderr and "build_ext --inplace" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr, p.stderr


def _train_main(*args):
    """train.main in this process: (exit code or error line, output). For runs that stop early or train a
    few steps, without the ~2 s of `import torch` a subprocess costs. Any exception other than SystemExit
    propagates and fails the case: it is the traceback a user would see."""
    import train
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            train.main(list(args))
        except SystemExit as e:
            return e.code, out.getvalue()
    return 0, out.getvalue()


def _train_fails(what, words, *args):
    """train.main(args) ends in one `train.py: error:` line that holds every word of words."""
    code, out = _train_main(*args)
    assert isinstance(code, str) and code.startswith("train.py: error: ") and "\n" not in code, \
        f"{what}: expected one error line, got exit {code!r}\n{out[-1500:]}"
    missing = [w for w in words if w not in code]
    assert not missing, f"{what}: {missing} not in: {code}"
    return code


def _train_tiny_args(folder, *more):
    """The tiny config on a generated text, writing to folder/out."""
    return (*_TRAIN_TINY, f"--data_path={_train_text_file(folder)}", f"--out_dir={os.path.join(folder, 'out')}", *more)


def train_help():
    import train
    missing = [k for k in train.DEFAULTS if not train.HELP.get(k)]
    assert not missing, f"keys without a --help description: {missing}"
    code, out = _train_main("--help")
    assert code == 0, f"--help exited {code!r}"
    lines = out.splitlines()
    for k, v in train.DEFAULTS.items():
        at = next((i for i, ln in enumerate(lines) if ln.strip().startswith(f"--{k}=")), None)
        shown = " ".join(lines[at:at + 2]) if at is not None else ""  # a long default puts its meaning below
        assert f"--{k}={v}" in shown and train.HELP[k] in shown, f"--help line of {k}: {shown!r}"
    for title, choices in (("--preset choices", train.PRESETS), ("--backend choices", data.BACKENDS)):
        at = next((i for i, ln in enumerate(lines) if ln.startswith(title)), None)
        assert at is not None, f"--help has no {title!r} section"
        assert all(any(ln.split()[:1] == [c] for ln in lines[at + 1:]) for c in choices), f"{title}: {choices}"
    for script in ("train.py", "inference.py"):  # as `--help | head`: the reader has gone before the text comes
        proc = subprocess.Popen([sys.executable, script, "--help"], cwd=HERE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        proc.stdout.close()  # before the script has imported torch, let alone printed
        err = proc.stderr.read()
        assert proc.wait(timeout=60) == 0 and not err, \
            f"{script} into a closed pipe: exit {proc.returncode}, {err[-1500:]}"
    return f"{len(train.DEFAULTS)} keys described, preset and backend choices listed; quiet into a closed pipe"


def train_rejects_bad_values():
    p = _train_run("--lr=-1", "--max_iters=1", "--device=cpu")  # end to end: this was a traceback from AdamW
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert p.stderr.strip() == "train.py: error: --lr must be > 0, got -1.0", p.stderr
    with tempfile.TemporaryDirectory() as tmp:
        for arg, words in (("--lr=nan", ("--lr", "finite", "nan")), ("--lr=inf", ("--lr", "finite")),
                           ("--beta1=1", ("--beta1", "[0, 1)")), ("--beta2=-0.5", ("--beta2", "[0, 1)")),
                           ("--weight_decay=-1", ("--weight_decay", ">= 0")),
                           ("--arch=bert", ("--arch", "gpt", "llama", "bert")),
                           ("--n_kv_head=3", ("--n_kv_head", "divide", "--n_head (2)")),
                           ("--dropout=1", ("--dropout", "[0, 1)")), ("--dropout=-0.1", ("--dropout", "[0, 1)")),
                           ("--lr_schedule=linear", ("--lr_schedule", "constant or cosine", "'linear'")),
                           ("--warmup_iters=-1", ("--warmup_iters", ">= 0")),
                           ("--lr_schedule=cosine --min_lr=0", ("--min_lr", "(0, 0.0003]", "got 0.0")),
                           ("--lr_schedule=cosine --min_lr=1e-3", ("--min_lr", "(0, 0.0003]", "got 0.001")),
                           ("--lr_schedule=cosine --warmup_iters=1", ("--warmup_iters", "< --max_iters (1)", "got 1"))):
            _train_fails(arg, words, *_train_tiny_args(tmp, "--max_iters=1", *arg.split()))
        _train_fails("odd llama head", ("--arch=llama", "even", "15"),
                     *_train_tiny_args(tmp, "--max_iters=1", "--arch=llama", "--n_embd=30"))
        _train_fails("dropout in the sweep", ("--dropout", "sweep"),
                     *_train_tiny_args(tmp, "--max_iters=1", "--dropout=0.1", "--sweep=increment"))
        _train_fails("cosine in the sweep", ("--lr_schedule=cosine", "sweep", "constant"),
                     *_train_tiny_args(tmp, "--max_iters=1", "--lr_schedule=cosine", "--sweep=increment"))
    return "--lr=-1: one line, no traceback; nan, inf, betas, decay, arch, heads, dropout and the lr schedule checked"


@mutant("dropout_range_unchecked", "train/rejects_bad_values")
def _dropout_range_unchecked():
    # --dropout=1 trains (every value dropped), --dropout=-0.1 runs as a negative p
    real = train.check_compile

    def check(cfg):
        cfg.dropout = min(max(cfg.dropout, 0.0), 0.5)
        return real(cfg)
    with unittest.mock.patch.object(train, "check_compile", check):
        yield


def train_compile_option():
    # --compile=true is refused in one line that names it wherever it cannot do what it says; the compiled
    # step itself runs on a GPU only (train/gpu_compiled_torch_step)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert train.parse_config(["--device=cpu", "--compile=false"]).compile is False, "--compile=false"
    assert train.DEFAULTS["compile"] is False, "compile is on by default"
    with tempfile.TemporaryDirectory() as tmp:
        args = _train_tiny_args(tmp, "--max_iters=1", "--compile=true")
        for more, words in (((), ("--compile=true", "GPU", "--device=cpu")),
                            (("--graph_torch=true",), ("--compile=true", "--graph_torch=true")),
                            (("--preset=mhc-demo",), ("--compile=true", "sweep"))):
            _train_fails(" ".join(("--compile=true",) + more), words, *args, *more)
    return "--compile=false parses; with graph_torch, a sweep or on the CPU: one line each"


def train_llama_cpu():
    # the llama arch trains on the PyTorch op set, saves, resumes, and a resume as gpt is refused
    with tempfile.TemporaryDirectory() as tmp:
        args = _train_tiny_args(tmp, "--arch=llama", "--max_iters=3")
        out = _train_main_ok(*args)
        assert "op sets: torch" in out, out[-1500:]
        ckpt = _train_load_ckpt(os.path.join(tmp, "out", "ckpt_torch.pt"))
        assert ckpt["config"]["arch"] == "llama" and ckpt["config"]["n_kv_head"] == 1, ckpt["config"]
        names = set(ckpt["model"])
        assert "blocks.0.mlp.up_w" in names and "wpe" not in names and not any(n.endswith("_b") for n in names), names
        out = _train_main_ok(*args[:-1], "--max_iters=5", "--resume=true")
        assert "iterations 4..5" in out, out[-1500:]
        _train_fails("resume as gpt", ("arch=llama",), *args[:-1], "--max_iters=6", "--resume=true", "--arch=gpt")
    return "3 steps, checkpoint (no biases, no wpe, 1 K/V head), resumed to 5; resuming as gpt refused"


def train_bf16_cpu():
    # --dtype=bf16 trains the torch op set under autocast (on the CPU too), from fp32 master weights that
    # the checkpoint keeps in fp32, with the mHC streams too (kept in fp32); a bad value is refused in one line
    with tempfile.TemporaryDirectory() as tmp:
        out = _train_main_ok(*_train_tiny_args(tmp, "--dtype=bf16", "--max_iters=3"))
        assert "results on cpu, bf16" in out, out[-1500:]
        ckpt = _train_load_ckpt(os.path.join(tmp, "out", "ckpt_torch.pt"))
        assert ckpt["config"]["dtype"] == "bf16", ckpt["config"]
        assert all(t.dtype == torch.float32 for t in ckpt["model"].values() if t.is_floating_point()), "weights"
        _train_fails("--dtype=fp16", ("--dtype", "fp32", "bf16", "fp16"), *_train_tiny_args(tmp, "--dtype=fp16"))
    losses = []
    for res in ("mhc", "mhc-dynamic"):
        with tempfile.TemporaryDirectory() as tmp:
            out = _train_main_ok(*_train_tiny_args(tmp, "--dtype=bf16", f"--residual={res}", "--max_iters=3"))
            assert "results on cpu, bf16" in out, out[-1500:]
            losses.append(re.search(r"^torch\s+\w+\s+3\s+([\d.]+)", out, re.M).group(1))
    return (f"3 bf16 steps under autocast, fp32 master weights saved; mhc and mhc-dynamic train (loss "
            f"{', '.join(losses)}); --dtype=fp16 refused")


def train_rejects_bad_paths():
    with tempfile.TemporaryDirectory() as tmp:
        text = _train_text_file(tmp)
        binary = os.path.join(tmp, "program")
        with open(binary, "wb") as f:
            f.write(b"\x7fELF\x02\x01\x01\x00" + bytes(range(128, 256)))
        out = os.path.join(tmp, "out")
        base = (*_TRAIN_TINY, "--max_iters=1")
        _train_fails("--out_dir=FILE", ("--out_dir", text, "is a file"),
                     *base, f"--data_path={text}", f"--out_dir={text}")
        _train_fails("binary --data_path", ("not UTF-8", binary), *base, f"--data_path={binary}", f"--out_dir={out}")
        msg = _train_fails("directory --data_path", ("directory", tmp), *base, f"--data_path={tmp}", f"--out_dir={out}")
        assert "not found" not in msg, msg
        assert os.listdir(out) == [], f"files written before the error: {os.listdir(out)}"
    return "out_dir that is a file, binary and directory data_path: one line each, before training"


def _png_title(path):
    from PIL import Image  # matplotlib's own dependency
    with Image.open(path) as im:
        return im.text.get("Title")


def train_max_iters_zero():
    # Also the report of a run of one op set (the torch one, on a CPU): named as such, not "both".
    with tempfile.TemporaryDirectory() as tmp:
        code, out = _train_main(*_train_tiny_args(tmp, "--max_iters=0", "--plot=true"))
        assert code == 0, f"exit {code!r}\n{out[-1500:]}"
        assert "checkpoint is at iteration" not in out, out
        assert "nothing to train: max_iters=0" in out, out
        out_dir = os.path.join(tmp, "out")
        assert sorted(os.listdir(out_dir)) == ["loss.png", "results.json"], os.listdir(out_dir)
        with open(os.path.join(out_dir, "results.json")) as f:
            r = json.load(f)
        assert r["config"]["backend"] == "torch" and list(r["op_sets"]) == ["torch"], (r["config"], list(r["op_sets"]))
        title = _png_title(os.path.join(out_dir, "loss.png"))
        assert title == "char GPT: PyTorch op set", f"loss.png title {title!r}"
    return f"untrained model evaluated, no checkpoint claimed; backend torch, plot {title!r}"


def train_fresh_run_keeps_checkpoint():
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "out", "ckpt_torch.pt")
        os.makedirs(os.path.dirname(ckpt))
        with open(ckpt, "wb") as f:
            f.write(b"an earlier run")
        _train_fails("fresh run", (ckpt, "already exists", "--resume=true", "--overwrite=true", "--out_dir"),
                     *_train_tiny_args(tmp, "--max_iters=1"))
        with open(ckpt, "rb") as f:
            assert f.read() == b"an earlier run", "the existing checkpoint was touched"
        code, out = _train_main(*_train_tiny_args(tmp, "--max_iters=0", "--overwrite=true"))
        assert code == 0, f"--overwrite=true refused: {code!r}\n{out[-1500:]}"
    return "refused without --resume=true or --overwrite=true"


def _flip_weight_bytes(blob):
    """blob (a checkpoint) with 8 bytes of its first tensor, the token embedding, set to 0xff (NaN): the zip
    stays valid, since torch.load does not check the CRCs."""
    with zipfile.ZipFile(io.BytesIO(blob)) as zf:
        info = zf.getinfo(next(n for n in zf.namelist() if n.endswith("/data/0")))
    at = info.header_offset
    name_len = int.from_bytes(blob[at + 26:at + 28], "little")
    extra_len = int.from_bytes(blob[at + 28:at + 30], "little")
    start = at + 30 + name_len + extra_len + 16  # past the local file header, into the tensor's bytes
    return blob[:start] + b"\xff" * 8 + blob[start + 8:]


def _flip_optimizer_bytes(blob):
    """blob (a checkpoint) with 64 bytes of AdamW's first moment (exp_avg) of the first parameter XORed with 1:
    finite values a little off, which a resume would take silently without a checksum over the optimizer state."""
    exp_avg = torch.load(io.BytesIO(blob), weights_only=True)["optimizer"]["state"][0]["exp_avg"]
    raw = exp_avg.contiguous().view(torch.uint8).numpy().tobytes()
    at = blob.find(raw)  # torch.save stores each tensor's bytes as they are (uncompressed) in the zip
    assert at > 0 and blob.find(raw, at + 1) < 0 and len(raw) >= 64, "exp_avg's bytes not found once"
    return blob[:at] + bytes(b ^ 1 for b in blob[at:at + 64]) + blob[at + 64:]


def train_bad_checkpoints():
    with tempfile.TemporaryDirectory() as tmp:
        args = _train_tiny_args(tmp)
        code, out = _train_main(*args, "--max_iters=3")
        assert code == 0, f"exit {code!r}\n{out[-1500:]}"
        ckpt = os.path.join(tmp, "out", "ckpt_torch.pt")
        with open(ckpt, "rb") as f:
            good = f.read()
        foreign = io.BytesIO()
        torch.save({"weights": torch.ones(3)}, foreign)
        corrupted = "the file is corrupted: the sha256 of its"
        cases = (("truncated", good[:len(good) // 2], ("truncated",)),
                 ("empty", b"", ("empty",)),
                 ("not torch", bytes(range(256)) * 8, ("not a PyTorch checkpoint",)),
                 ("another torch file", foreign.getvalue(), ("not a train.py checkpoint", "weights")),
                 ("flipped weight bytes", _flip_weight_bytes(good), (f"{corrupted} weights differs",)),
                 ("flipped optimizer bytes", _flip_optimizer_bytes(good), (f"{corrupted} optimizer state differs",)))
        for what, blob, words in cases:
            with open(ckpt, "wb") as f:
                f.write(blob)
            _train_fails(what, ("cannot resume from", ckpt, *words), *args, "--max_iters=4", "--resume=true")
            with open(ckpt, "rb") as f:
                assert f.read() == blob, f"{what}: the refused resume wrote the file"
        # a file from before whole-checkpoint checksums (the weights' alone) still resumes, and says what it lacks
        old = torch.load(io.BytesIO(good), weights_only=True)
        del old["sha256"], old["timing"]
        old["model_sha256"] = data.weights_sha256(old["model"])
        torch.save(old, ckpt)
        code, out = _train_main(*args, "--max_iters=4", "--resume=true")
        assert code == 0 and "predates whole-checkpoint checksums" in out, f"exit {code!r}\n{out[-1500:]}"
    return ", ".join(c[0] for c in cases) + ": one line each; a weights-only checksum resumes with a note"


@mutant("checkpoint_checksum_covers_weights_only", "train/bad_checkpoints")
def _checksum_covers_weights_only():
    real = data.checkpoint_digests
    with unittest.mock.patch.object(data, "checkpoint_digests", lambda ckpt: {"model": real(ckpt)["model"]}):
        yield


def train_diverged_run_keeps_checkpoint():
    with tempfile.TemporaryDirectory() as tmp:
        args = _train_tiny_args(tmp)
        code, out = _train_main(*args, "--max_iters=3")
        assert code == 0, f"exit {code!r}\n{out[-1500:]}"
        out_dir = os.path.join(tmp, "out")
        ckpt = os.path.join(out_dir, "ckpt_torch.pt")
        with open(ckpt, "rb") as f:
            good = f.read()
        # end to end, as reported: a resume with a learning rate that blows up (and another batch size)
        p = _train_run(*args, "--max_iters=40", "--resume=true", "--lr=1e6", "--batch_size=8", "--plot=true")
        assert p.returncode != 0 and "Traceback" not in p.stderr, f"exit {p.returncode}\n{p.stderr[-2000:]}"
        assert "batch_size=4, lr=0.0003" in p.stdout and "batch_size=8, lr=1000000.0" in p.stdout, \
            f"changed hyperparameters not reported:\n{p.stdout}"
        last = p.stderr.strip().splitlines()[-1]
        m = re.fullmatch(r"train\.py: error: the torch op set diverged: loss is (nan|inf) at iteration (\d+); "
                         r"training stopped, (\S+) still holds iteration 3; try a smaller --lr", last)
        assert m and m.group(3) == ckpt, f"unexpected last line: {last}"
        with open(ckpt, "rb") as f:
            assert f.read() == good, "the good checkpoint was overwritten"
        with open(os.path.join(out_dir, "results.json")) as f:
            r = json.load(f)
        assert r["status"] == "diverged" and r["op_sets"]["torch"]["stopped_at"] == int(m.group(2)), r
        title = _png_title(os.path.join(out_dir, "loss.png"))
        expected = f"char GPT: PyTorch op set (torch diverged at iteration {m.group(2)})"
        assert title == expected, f"loss.png title {title!r}, expected {expected!r}"
        assert "no sample from the torch model: it diverged" in p.stdout, p.stdout
    return f"loss {m.group(1)} at iteration {m.group(2)}: stopped, checkpoint of iteration 3 kept, results written"


def _signal_when(cmd, pattern, signum, before=None, group=False, env=None, timeout=120):
    """Runs cmd, and sends it signum once a line of its stdout matches pattern; with group=True to its whole process
    group, as a terminal's Ctrl-C reaches torchrun and its ranks. before(line) runs first. Returns (proc, the rest
    of stdout, stderr)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE,
                            start_new_session=group, env=env)
    watchdog = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL) if group else proc.kill())
    watchdog.start()
    try:
        for line in proc.stdout:
            if re.search(pattern, line):
                break
        else:
            raise AssertionError(f"no line matched {pattern!r}: exit {proc.wait()}\n{proc.stderr.read()[-1500:]}")
        if before:
            before(line)
        os.killpg(proc.pid, signum) if group else proc.send_signal(signum)
        out, err = proc.communicate()
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL) if group else proc.kill()
            proc.wait()
    return proc, out, err


def _interrupted_run(out_dir, err, launch):
    """The iteration of the interrupted run's last line, after checking the line, its checkpoint, results.json and
    that no lock or temp file is left; and how it said the run stopped."""
    ckpt = os.path.join(out_dir, "ckpt_torch.pt")
    last = err.strip().splitlines()[-1] if err.strip() else ""
    m = re.fullmatch(r"train\.py: the torch op set stopped on (.+) after iteration (\d+); saved (\S+) and (\S+); "
                     rf"resume with: {launch} train\.py (.*) --resume=true", last)
    assert m and m.group(3) == ckpt and m.group(4) == os.path.join(out_dir, "results.json"), f"last line: {last}"
    k = int(m.group(2))
    ck = _train_load_ckpt(ckpt)
    assert ck["iter"] == k and len(ck["train_loss"]) == k, (k, ck["iter"], len(ck["train_loss"]))
    with open(os.path.join(out_dir, "results.json")) as f:
        r = json.load(f)
    assert r["status"] == "interrupted" and r["op_sets"]["torch"]["stopped_at"] == k, r["op_sets"]["torch"]
    left = [f for f in os.listdir(out_dir) if ".tmp" in f or f.endswith(".lock")]
    assert not left, f"left behind: {left}"
    return k, m.group(1)


def train_interrupt_saves_checkpoint():
    # Ctrl-C (SIGINT) or SIGTERM mid-run: the step in flight completes, the checkpoint and results.json are written,
    # the lock file removed; the last line says how to resume, and the exit code is the signal's (130, 143)
    seen = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        with tempfile.TemporaryDirectory() as tmp:
            # No evaluation before the signal: a checkpoint on disk afterwards comes from the stop.
            args = _train_tiny_args(tmp, "--max_iters=100000", "--eval_interval=100000")
            proc, _, err = _signal_when([sys.executable, "-u", "train.py", *args], r"\| iter +\d+/100000 \|", signum)
            assert proc.returncode == 128 + signum and "Traceback" not in err, f"exit {proc.returncode}\n{err[-2000:]}"
            k, how = _interrupted_run(os.path.join(tmp, "out"), err, "python")
            assert how == data.signal_words(signum), how
            code, out = _train_main(*args, f"--max_iters={k + 1}", "--resume=true")
            assert code == 0 and f"resuming from iteration {k}" in out, f"exit {code!r}\n{out[-1500:]}"
            seen.append(f"{signal.Signals(signum).name} at iteration {k}")
    return ", ".join(seen) + ": checkpoint and results saved, no lock left, resumed"


_SIGTERM_KILLS = """
import contextlib, signal, data
data.STOP_SIGNALS = (signal.SIGINT,)
data.sigterm_interrupts = contextlib.nullcontext
"""


@mutant("sigterm_ends_a_run_at_once", "train/interrupt_saves_checkpoint", "inference/sigterm_keeps_results")
def _sigterm_ends_a_run_at_once():
    """SIGTERM's default action: the process ends where it is, nothing saved, the lock file left."""
    with planted_in_subprocesses(_SIGTERM_KILLS):
        yield


def train_torchrun_ctrl_c():
    # Ctrl-C in the terminal of a torchrun run: torchrun and both ranks get SIGINT, and torchrun SIGKILLs the ranks
    # after its grace period (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s; 10 here). With no log or eval point in sight,
    # the ranks must agree to stop after a step: rank 0 saves the checkpoint and results.json, and leaves no lock.
    with tempfile.TemporaryDirectory() as tmp:
        args = _train_tiny_args(tmp, "--max_iters=100000", "--eval_interval=100000", "--log_interval=100000",
                                "--batch_size=2", "--sample_len=0")
        cmd = [sys.executable, "-u", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
               *args]
        t0 = time.perf_counter()
        proc, out, err = _signal_when(cmd, r"\| training eager on cpu", signal.SIGINT, group=True,
                                      before=lambda line: time.sleep(2),  # well into the loop
                                      env={**os.environ, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "10"})
        seconds = time.perf_counter() - t0
        assert proc.returncode != 0, f"torchrun exited 0:\n{err[-1500:]}"
        ours = [ln for ln in err.splitlines() if ln.startswith("train.py: ")]
        assert len(ours) == 1, f"expected rank 0's line alone:\n{err[-3000:]}"
        k, how = _interrupted_run(os.path.join(tmp, "out"), ours[0],
                                  re.escape("torchrun --standalone --nproc_per_node=2"))
    return f"stopped on {how} after iteration {k}, {seconds:.0f} s after the start; checkpoint, results, no lock"


@mutant("torchrun_ranks_never_agree_to_stop", "train/torchrun_ctrl_c")
def _torchrun_ranks_never_agree_to_stop():
    """As when the ranks only agreed at log and eval points, and none came before torchrun's SIGKILL."""
    with planted_in_subprocesses("import data\ndata.Ranks.any = lambda self, flag: flag if self.world == 1 else False"):
        yield


def train_torchrun_refusal():
    # a refused torchrun run (its out_dir holds another run's checkpoint) says so in one line, from rank 0, and
    # exits non-zero; the other rank stops without a word (torchrun then reports the failed ranks its own way)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "out", "ckpt_torch.pt")
        os.makedirs(os.path.dirname(ckpt))
        with open(ckpt, "wb") as f:
            f.write(b"an earlier run")
        p = _torchrun(*_train_tiny_args(tmp, "--max_iters=2"), timeout=120)
        ours = [ln for ln in p.stderr.splitlines() if ln.startswith("train.py: ")]
        assert p.returncode != 0 and len(ours) == 1, f"exit {p.returncode}, our lines: {ours}\n{p.stderr[-2000:]}"
        assert ours[0].startswith(f"train.py: error: {ckpt} already exists"), ours[0]
        assert "op sets:" not in p.stdout, f"training began:\n{p.stdout[-1500:]}"
    return one_line(ours[0])[:120]


@mutant("torchrun_ranks_refuse_alone", "train/torchrun_refusal")
def _torchrun_ranks_refuse_alone():
    """Rank 0's refusal not shared: rank 1 goes on alone and fails too, with a message of its own."""
    with planted_in_subprocesses("import data\ndata.Ranks.any = lambda self, flag: flag"):
        yield


def train_resume_nothing_to_train():
    # a resume with nothing left to train reports the run's figures (wall time, tok/s, timed steps: kept in the
    # checkpoint), not those of a session that trained nothing
    with tempfile.TemporaryDirectory() as tmp:
        args = _train_tiny_args(tmp, "--max_iters=7", "--timing_warmup=0")  # steps 5..7 timed (warm-up: 4)
        path = os.path.join(tmp, "out", "results.json")
        _train_main_ok(*args)
        with open(path) as f:
            first = json.load(f)["op_sets"]["torch"]
        out = _train_main_ok(*args, "--resume=true")
        assert "nothing to train" in out, out[-1500:]
        with open(path) as f:
            again = json.load(f)["op_sets"]["torch"]
        assert first["timed_iters"] == 3 and again["timed_iters"] == 3, (first["timed_iters"], again["timed_iters"])
        assert again["tokens_per_s"] == first["tokens_per_s"], (first["tokens_per_s"], again["tokens_per_s"])
        assert again["wall_s"] >= first["wall_s"] * 0.5, (first["wall_s"], again["wall_s"])  # the first run's, at
        assert again["final_val_loss"] == first["final_val_loss"] and again["sample"] == first["sample"]  # its save
    return f"tok/s {again['tokens_per_s']:,.0f} and wall {again['wall_s']:.2f} s kept (first run: {first['wall_s']:.2f} s)"


@mutant("resume_forgets_the_runs_timing", "train/resume_nothing_to_train")
def _resume_forgets_timing():
    real = data.load_checkpoint
    with unittest.mock.patch.object(train, "load_checkpoint", lambda *a: real(*a)[:3] + (data.NO_TIMING,)):
        yield


def train_interrupted_sample():
    # Ctrl-C during the sample after training: the checkpoint is there, and so are results.json and loss.png,
    # marked interrupted; exit 130 and the line that says so
    with tempfile.TemporaryDirectory() as tmp:
        def interrupted(*a):
            raise KeyboardInterrupt
        with unittest.mock.patch.object(train, "generate", interrupted):
            try:
                code, out = _train_main(*_train_tiny_args(tmp, "--max_iters=3", "--plot=true"))
            except KeyboardInterrupt:
                raise AssertionError("the KeyboardInterrupt of the sample left train.main") from None
        out_dir = os.path.join(tmp, "out")
        assert code == 130, f"exit {code!r}\n{out[-1500:]}"
        assert sorted(os.listdir(out_dir)) == ["ckpt_torch.pt", "loss.png", "results.json"], os.listdir(out_dir)
        with open(os.path.join(out_dir, "results.json")) as f:
            r = json.load(f)
        why = r["op_sets"]["torch"]["stopped_because"]
        assert r["status"] == "interrupted" and why == "Ctrl-C (SIGINT) during the sample, after training", r
        assert "the torch op set stopped on Ctrl-C (SIGINT) during the sample" in out, out[-1500:]
    return why


@mutant("sample_interrupt_unhandled", "train/interrupted_sample")
def _sample_interrupt_unhandled():
    with unittest.mock.patch.object(train.OpSetRun, "sample",
                                    lambda self: train.generate(self.model, self.tok, self.cfg, self.device)):
        yield


def train_home_in_paths():
    # --data_path=~/book.txt and --out_dir=~/runs: the ~ the shell leaves in --key=~/... is the home folder
    with tempfile.TemporaryDirectory() as tmp:
        _train_text_file(tmp)
        with unittest.mock.patch.dict(os.environ, {"HOME": tmp}):
            code, out = _train_main(*_TRAIN_TINY, "--data_path=~/tiny.txt", "--out_dir=~/runs", "--max_iters=0")
        assert code == 0, f"exit {code!r}\n{out[-1500:]}"
        assert os.path.isfile(os.path.join(tmp, "runs", "results.json")), os.listdir(tmp)
    return "~/tiny.txt read, ~/runs written"


@mutant("tilde_left_in_paths", "train/home_in_paths")
def _tilde_left_in_paths():
    with unittest.mock.patch.object(data, "PATH_OPTIONS", set()):
        yield


def train_out_of_memory():
    # a model too large for memory, in train.py and in inference.py: one line naming the size options, not a
    # traceback (a 2^23-wide layer asks the CPU allocator for more than any address space holds: it fails at once)
    wide = f"--n_embd={2 ** 23}"
    with tempfile.TemporaryDirectory() as tmp:
        msg = _train_fails(wide, ("out of memory on cpu", "tried to allocate", "--n_layer", "--n_embd", "--batch_size"),
                           *_train_tiny_args(tmp, wide, "--n_head=1"))
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                inference.main([*_INF_TINY, wide, "--n_head=1", "--models=dense", f"--out_dir={tmp}"])
                code = 0
            except SystemExit as e:
                code = e.code
        assert isinstance(code, str) and code.startswith("inference.py: error: out of memory on cpu") and \
            "--n_embd" in code, f"inference.py {wide}: {code!r}\n{out.getvalue()[-1500:]}"
    return msg[len("train.py: error: "):][:120]


@mutant("out_of_memory_traceback", "train/out_of_memory")
def _out_of_memory_traceback():
    with unittest.mock.patch.object(train, "is_out_of_memory", lambda e: False), \
            unittest.mock.patch.object(data, "is_out_of_memory", lambda e: False):
        yield


def train_option_typos():
    # a near miss names the key it is near; a key without its value says how to give one
    _train_fails("--max_iter=3", ["--max_iter", "did you mean --max_iters?"], "--max_iter=3")
    _train_fails("--resume", ["--resume needs a value", "--resume=VALUE"], "--resume")
    code = _train_fails("--zzz=1", ["unknown option --zzz"], "--zzz=1")
    assert "did you mean" not in code, code


def train_llama_odd_heads_note():
    # llama's default K/V grouping halves the heads; an odd count cannot be halved, and a line says so
    import train
    cfg = types.SimpleNamespace(arch="llama", n_head=3, n_kv_head=0, n_embd=48)
    with contextlib.redirect_stdout(io.StringIO()) as out:
        train.check_arch(cfg, train.fail)
    assert cfg.n_kv_head == 3 and "odd --n_head=3" in out.getvalue(), (cfg.n_kv_head, out.getvalue())
    cfg = types.SimpleNamespace(arch="llama", n_head=4, n_kv_head=0, n_embd=48)
    with contextlib.redirect_stdout(io.StringIO()) as out:
        train.check_arch(cfg, train.fail)
    assert cfg.n_kv_head == 2 and not out.getvalue(), (cfg.n_kv_head, out.getvalue())


def _lock_holder(out_dir, held):
    """A run (forked from this process) that holds out_dir's lock until it is killed."""
    with data.out_dir_lock(out_dir, "train.py", sys.exit):
        held.set()
        time.sleep(60)


def train_out_dir_lock():
    # a second run into a folder a live run holds fails with one line naming it; the file of a run that was
    # killed blocks nothing; a run that ends leaves no lock behind, and the next main() in this process runs
    with tempfile.TemporaryDirectory() as tmp:
        args = _train_tiny_args(tmp, "--max_iters=0")
        out = os.path.join(tmp, "out")
        lock = os.path.join(out, ".train.lock")
        os.makedirs(out)
        held = _FORK.Event()
        holder = _FORK.Process(target=_lock_holder, args=(out, held))
        holder.start()
        try:
            assert held.wait(30), "the holder did not take the lock"
            _train_fails("a held out_dir", ["in use by another train.py run", f"process {holder.pid}"], *args)
        finally:
            holder.kill()  # SIGKILL: its lock file stays, naming it
            holder.join()
        with open(lock) as f:
            assert f.read() == str(holder.pid), "the holder's pid is not in its lock file"
        for run in ("after a killed holder", "again in this process"):
            code, log = _train_main(*args)
            assert code == 0, f"{run}: exit {code}:\n{log[-1500:]}"
            assert not os.path.exists(lock), f"{run}: the run left its lock behind"
    return "held: refused, naming the holder; a killed holder's file: taken; released at the end"


@mutant("out_dir_lock_holds_nothing", "train/out_dir_lock")
def _lock_holds_nothing():
    with _planted_lock(lambda out_dir, script, fail: contextlib.nullcontext()):
        yield


@mutant("out_dir_lock_blocked_by_a_dead_runs_file", "train/out_dir_lock")
def _lock_blocked_by_file():
    """A lock file that exists refuses the run, whether or not its process lives."""
    @contextlib.contextmanager
    def exclusive_create(out_dir, script, fail):
        path = os.path.join(out_dir, f".{script.removesuffix('.py')}.lock")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            with open(path) as f:
                fail(f"--out_dir={out_dir} is in use by another {script} run (process {f.read()})")
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        try:
            yield
        finally:
            os.remove(path)

    with _planted_lock(exclusive_create):
        yield


def _torchrun(*args, nproc=2, timeout=180):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           "train.py", *args], cwd=HERE, capture_output=True, text=True, timeout=timeout)


class _FunctionalGPT(torch.nn.Module):
    """A small GPT written the usual way, on torch.nn and torch.nn.functional (not this repo's model), its token
    embedding's row 0 a padding row, as Hugging Face's models keep one (no gradient)."""

    def __init__(self, vocab=48, width=64, heads=2, layers=2, context=32):
        super().__init__()
        self.heads = heads
        self.tok, self.pos = torch.nn.Embedding(vocab, width, padding_idx=0), torch.nn.Embedding(context, width)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict(dict(
            ln1=torch.nn.LayerNorm(width), qkv=torch.nn.Linear(width, 3 * width), proj=torch.nn.Linear(width, width),
            ln2=torch.nn.LayerNorm(width), fc=torch.nn.Linear(width, 4 * width), out=torch.nn.Linear(4 * width, width)))
            for _ in range(layers))
        self.ln_f, self.head = torch.nn.LayerNorm(width), torch.nn.Linear(width, vocab, bias=False)

    def forward(self, idx, targets):
        B, T = idx.shape
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        for b in self.blocks:
            q, k, v = b.qkv(b.ln1(x)).view(B, T, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + b.proj(y.transpose(1, 2).reshape(B, T, -1))
            x = x + b.out(F.gelu(b.fc(b.ln2(x)), approximate="tanh"))
        # targets: a slice; -100 where ignored, as Hugging Face pads labels
        return F.cross_entropy(self.head(self.ln_f(x)).view(B * T, -1), targets.reshape(-1))


def train_ddp_two_ranks():
    # 2 ranks at batch 2 (gloo, torch op set) train on the rows one process sees at batch 4: the same
    # losses to fp32 rounding. The 2-rank run stops at 3 and resumes to 6 from rank 0's checkpoint.
    with tempfile.TemporaryDirectory() as tmp:
        common = [*_TRAIN_TINY, f"--data_path={_train_text_file(tmp)}", "--sample_len=0"]
        one = _train_run(*common, f"--out_dir={tmp}/one", "--max_iters=6")
        _train_check_ok(one, "one process, batch 4")
        two = [*common, f"--out_dir={tmp}/two", "--batch_size=2"]
        _train_check_ok(_torchrun(*two, "--max_iters=3"), "torchrun 2 ranks, batch 2, iterations 1..3")
        p = _torchrun(*two, "--max_iters=6", "--resume=true")
        _train_check_ok(p, "torchrun 2 ranks, resumed to 6")
        assert "cpu x 2, global batch 2 x 2" in p.stdout, f"no global batch in:\n{p.stdout[-1500:]}"
        assert p.stdout.count("resuming from iteration 3") == 1, f"rank 0 alone should print:\n{p.stdout[-1500:]}"
        a = _train_load_ckpt(f"{tmp}/one/ckpt_torch.pt")["train_loss"]
        b = _train_load_ckpt(f"{tmp}/two/ckpt_torch.pt")["train_loss"]
        diff = [abs(x - y) for x, y in zip(a, b, strict=True)]
        assert max(diff) <= 1e-5, f"losses per iteration differ by {diff} (iterations 4..6 come after the resume)"
        results = json.load(open(f"{tmp}/two/results.json"))
        assert results["config"]["world_size"] == 2, results["config"]
    return f"6 losses within {max(diff):.1e} of one process at batch 4, resumed at 3"


@contextlib.contextmanager
def planted_in_subprocesses(code):
    """Python processes started inside the block run code first (a sitecustomize.py on PYTHONPATH): a fault
    planted in a script that a case runs as a subprocess, such as torchrun's ranks."""
    with tempfile.TemporaryDirectory() as folder:
        with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
            f.write(f"import sys\nsys.path.insert(0, {HERE!r})\n{code}")
        path = os.pathsep.join(p for p in (folder, os.environ.get("PYTHONPATH")) if p)
        with unittest.mock.patch.dict(os.environ, {"PYTHONPATH": path}):
            yield


@mutant("ddp_ranks_share_a_shard", "train/ddp_two_ranks")
def _ddp_ranks_share_a_shard():
    with planted_in_subprocesses("""
import data
_real = data.get_batch
def _rank_zero(ids, batch_size, block_size, generator, device="cpu", rank=0, world=1):
    return _real(ids, batch_size, block_size, generator, device, 0, world)
data.get_batch = _rank_zero
"""):
        yield


def _rank_processes(args_by_rank, port):
    """The ranks started as torchrun starts them (its environment variables), each with its own options."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(len(args_by_rank))}
    return [subprocess.Popen([sys.executable, "train.py", *args], cwd=HERE,
                             env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for r, args in enumerate(args_by_rank)]


def train_ddp_rank_failure():
    # rank 1 fails on its own (a data file it cannot read, a bad option before it joins): rank 0 stops
    # with a message that says so instead of waiting, once at the next collective, once at --dist_timeout
    with tempfile.TemporaryDirectory() as tmp:
        common = [*_TRAIN_TINY, f"--out_dir={tmp}/out", "--max_iters=4", "--dist_timeout=5"]
        good = f"--data_path={_train_text_file(tmp)}"
        seen = []
        for bad, says in ((f"--data_path={tmp}/missing.txt", "data file not found"),
                          ("--batch_size=0", "--batch_size must be >= 1")):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            t0 = time.perf_counter()
            procs = _rank_processes([[*common, good], [*common, good, bad]], port)
            outs = [p.communicate(timeout=120) for p in procs]
            seconds = time.perf_counter() - t0
            assert [p.returncode for p in procs] == [1, 1], f"exit codes {[p.returncode for p in procs]}: {outs}"
            assert says in outs[1][1], f"rank 1's stderr:\n{outs[1][1][-1500:]}"
            assert "rank 0 lost the other ranks" in outs[0][1], f"rank 0's stderr:\n{outs[0][1][-1500:]}"
            assert "Traceback" not in outs[0][1], f"rank 0 printed a traceback:\n{outs[0][1][-1500:]}"
            seen.append(f"{seconds:.0f} s")
    return f"rank 0 stopped with a message: after a crash ({seen[0]}), at the timeout ({seen[1]})"


def train_inductor_fallbacks():
    # register_inductor_fallbacks gives every overload of a namespace's ops Inductor's lowering for a custom
    # op (a call of the op, under the layout rule Inductor would pick), and a compiled call of one then runs
    # it; shown on the CPU with ops of a namespace of this test's own
    from torch._inductor import lowering
    from torch._library.utils import get_layout_constraint_tag
    if not hasattr(torch.ops.inductor_fallback_test, "scale"):
        lib = torch.library.Library("inductor_fallback_test", "DEF")
        lib.define("scale(Tensor x, float s) -> Tensor")
        lib.define("scale.twice(Tensor x, float s) -> Tensor")
        lib.impl("scale", lambda x, s: x * s, "CompositeExplicitAutograd")
        lib.impl("scale.twice", lambda x, s: x * (2 * s), "CompositeExplicitAutograd")
        train_inductor_fallbacks.lib = lib  # the registrations last as long as the library object
    ops = [torch.ops.inductor_fallback_test.scale.default, torch.ops.inductor_fallback_test.scale.twice]
    assert not any(op in lowering.lowerings for op in ops) or hasattr(train_inductor_fallbacks, "registered")
    data.register_inductor_fallbacks("inductor_fallback_test")
    train_inductor_fallbacks.registered = True  # a second run in this process finds them registered
    for op in ops:
        rule = lowering.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
        assert op in lowering.lowerings, f"{op} has no lowering"
        assert lowering.maybe_layout_constraints(op) is rule, f"{op}: {lowering.maybe_layout_constraints(op)}"
    x = torch.randn(7)
    compiled = torch.compile(lambda x: ops[1](ops[0](x + 1, 2.0), 3.0).sin(), fullgraph=True)
    check("compiled", compiled(x), ((x + 1) * 12).sin(), 1e-6)
    return f"{len(ops)} overloads lowered as calls with {lowering.maybe_layout_constraints(ops[0]).__name__}"


for _fn in (train_cpu_checkpoint_and_resume, train_rejects_unknown_key, train_rejects_bad_type, train_cuda_backend_on_cpu_errors,
            train_help, train_rejects_bad_values, train_compile_option, train_llama_cpu, train_bf16_cpu,
            train_rejects_bad_paths, train_option_typos, train_llama_odd_heads_note, train_out_dir_lock,
            train_max_iters_zero, train_fresh_run_keeps_checkpoint, train_bad_checkpoints,
            train_diverged_run_keeps_checkpoint, train_interrupt_saves_checkpoint, train_torchrun_ctrl_c,
            train_torchrun_refusal, train_resume_nothing_to_train, train_interrupted_sample, train_home_in_paths,
            train_out_of_memory, train_ddp_two_ranks, train_ddp_rank_failure, train_inductor_fallbacks,
            train_cpu_dropout_resume, train_cpu_dropout_off_in_eval, train_lr_schedule, train_cpu_lr_schedule_resume):
    add(_fn.__name__.replace("_", "/", 1), _fn, gpu=False)


# ==== script tests: inference.py ====
# the KV cache, the MoE feed-forward and the command line, on the CPU at tiny sizes


_INF_TINY = ["--device=cpu", "--n_layer=2", "--n_embd=32", "--n_head=2", "--block_size=24", "--n_expert=4",
             "--seeds=0", "--max_new_tokens=12", "--prompt=Oz", "--models=dense,moe"]


def _decoder_gpt(n_expert=0, device="cpu", n_embd=32, arch="gpt", seed=0):
    # llama: its default grouping, 1 K/V head for the 2 query heads. Drawn as inference.py draws its random
    # models, so that the next token depends on the context: a model that repeats its input token passes
    # a cache, slide or sampling test with the feature broken.
    mlp = (lambda: inference.MoE(n_embd, n_expert, 2, arch)) if n_expert else None
    return train.GPT(95, 24, n_embd, 2, 2, seed, train.TORCH_OPS, mlp=mlp, arch=arch,
                     init_std=inference.context_std(n_embd)).to(device).eval()


def _decode_mode(graphed):  # inference.Decoder's mode
    return "graph" if graphed else "eager"


def _greedy_without_cache(model, prompt, n_new):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n_new):
            logits, _ = model(torch.tensor([ids], device=model.wte.device))
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


def _decode(model, prompt, n_new, temperature=0.0, top_k=0, uniforms=None):
    dec = inference.Decoder(model, n_new, temperature, top_k, torch.rand(n_new) if uniforms is None else uniforms,
                            mode="eager")
    with torch.no_grad():
        inference.generate(dec, torch.tensor(prompt, device=model.wte.device), n_new)
    return dec


def _assert_depends_on_context(model, prompt, toks):
    """The test model's tokens vary and follow the whole context: a prompt that differs in its first token
    continues differently, and no token repeats more than 3 times in a row."""
    other = _greedy_without_cache(model, [(prompt[0] + 1) % 95] + prompt[1:], len(toks))
    assert other != toks, f"changing the prompt's first token changed nothing: {toks}"
    assert inference.longest_run(toks) <= 3, f"a token repeats {inference.longest_run(toks)} times: {toks}"


def inference_cache_matches_full_forward():
    # the cached decode (prefill, then one token a step) picks the tokens a full forward of the whole
    # context picks at every step, for the dense and the MoE feed-forward, gpt and llama (RoPE at the
    # cache position, a K/V head shared by two query heads)
    for arch in train.ARCHS:
        for n_expert in (0, 4):
            model = _decoder_gpt(n_expert, arch=arch)
            prompt, n_new = [5, 17, 42], 15  # 3 + 15 < 24: no slide
            dec = _decode(model, prompt, n_new)
            ref = _greedy_without_cache(model, prompt, n_new)
            assert dec.tokens.tolist() == ref, f"{arch}, n_expert={n_expert}: cache {dec.tokens.tolist()} vs full {ref}"
            _assert_depends_on_context(model, prompt, ref)
            assert (dec.margins >= 0).all(), "top-1 minus top-2 margin must be >= 0"
    assert dec.cache.k.shape[2] == 1, f"llama's cache holds {dec.cache.k.shape[2]} K/V heads, expected 1"
    return "gpt and llama, dense and MoE: 15 cached tokens equal the full-context argmax"


@mutant("kv_write_does_nothing", "inference/cache_matches_full_forward")
def _kv_write_does_nothing():
    with unittest.mock.patch.object(train.TORCH_OPS, "kv_write", lambda *args: None):
        yield


def inference_slides_when_full():
    # past the context, the newest half is prefilled again: the run goes on and equals a full forward
    # over that window. The prompt's 3 tokens and the first 21 new ones fill the 24 positions; new token
    # 21 is the last the full cache gives, so 22 is the first after the slide, predicted from the newest
    # 12 of the 25 tokens so far; from there each token sees the window grow from those 12.
    for arch in train.ARCHS:
        model, n_new, prompt = _decoder_gpt(arch=arch), 30, [1, 2, 3]
        toks = _decode(model, prompt, n_new).tokens.tolist()
        assert toks[:22] == _greedy_without_cache(model, prompt, 22), f"{arch}: tokens before the slide differ"
        context = prompt + toks
        for i in range(22, n_new):
            want = _greedy_without_cache(model, context[3 + 22 - 12:3 + i], 1)[0]
            assert toks[i] == want, f"{arch}: new token {i} is {toks[i]}, a full forward over its window gives {want}"
    return f"gpt and llama: {n_new} tokens through a context of 24; tokens 22-{n_new - 1} over the slid window"


@mutant("slide_keeps_one_token", "inference/slides_when_full")
def _slide_keeps_one_token():
    with unittest.mock.patch.object(inference, "slide_keep", lambda capacity: 1):
        yield


def _sample_without_cache(model, prompt, uniforms, temperature, k):
    """Sampling written out: each token drawn from softmax(logits / temperature) over the k largest logits of
    a full forward, by inverse CDF at its uniform draw."""
    ids = list(prompt)
    with torch.no_grad():
        for u in uniforms.tolist():
            logits = model(torch.tensor([ids]))[0][0, -1].double() / temperature
            top = torch.sort(logits, descending=True, stable=True)
            cdf = torch.softmax(top.values[:k], -1).cumsum(0)
            ids.append(int(top.indices[min(int((cdf < u).sum()), k - 1)]))
    return ids[len(prompt):]


def inference_sampling_is_seeded():
    # sampling with a temperature and top-k draws, at each step, the token that the written-out sampler draws
    # from a full forward with the same uniform; greedy decoding would pick other tokens
    model, n_new, prompt = _decoder_gpt(), 16, [4, 5]
    uniforms = torch.rand(n_new, generator=torch.Generator().manual_seed(3))
    toks = _decode(model, prompt, n_new, 0.8, 5, uniforms).tokens.tolist()
    want = _sample_without_cache(model, prompt, uniforms, 0.8, 5)
    assert toks == want, f"sampled {toks}, the written-out sampler draws {want}"
    greedy = _greedy_without_cache(model, prompt, n_new)
    differ = sum(a != b for a, b in zip(toks, greedy))
    assert differ >= n_new // 4, f"only {differ} of {n_new} sampled tokens differ from greedy: {toks}"
    return f"temperature 0.8, top-5: {n_new} tokens as drawn by hand, {differ} of them not the argmax"


@mutant("greedy_instead_of_sampling", "inference/sampling_is_seeded")
def _greedy_instead_of_sampling():
    real = inference.Decoder.__init__

    def greedy(self, model, n_new, temperature, *args, **kwargs):
        real(self, model, n_new, 0.0, *args, **kwargs)
    with unittest.mock.patch.object(inference.Decoder, "__init__", greedy):
        yield


def inference_moe_weights_sum_to_one():
    for arch in train.ARCHS:  # in float64, so that any difference is the routing's, not rounding's
        moe = _decoder_gpt(4, arch=arch).blocks[0].mlp.double()
        x = torch.randn(7, 32, dtype=torch.float64)
        with torch.no_grad():
            probs = torch.softmax(F.linear(x, moe.router_w), -1)
            top_p, top_i = torch.topk(probs, 2)
            w = top_p / top_p.sum(-1, keepdim=True)
            assert torch.allclose(w.sum(-1), torch.ones(7, dtype=torch.float64)), "renormalised weights do not sum to 1"
            ref = torch.stack([sum(w[t, s] * moe_expert(moe, int(top_i[t, s]), x[t]) for s in range(2))
                               for t in range(7)])
            many = moe(x, train.TORCH_OPS)  # all tokens at once: grouped by expert
            one = torch.stack([moe(x[t:t + 1], train.TORCH_OPS)[0] for t in range(7)])  # one token: expert GEMVs
        check(f"{arch}_grouped", many, ref, 1e-12)
        check(f"{arch}_one_token", one, ref, 1e-12)


@mutant("moe_drops_an_expert", "inference/moe_weights_sum_to_one")
def _moe_drops_an_expert():
    real = inference.MoE.params

    def last_expert_zero(self, name, expert=None):  # the last expert's weights read as zeros: its output is 0
        w, b = real(self, name, expert)
        last = self.router_w.shape[0] - 1
        if expert is None:
            w, b = w.clone(), None if b is None else b.clone()
            w[last] = 0
            if b is not None:
                b[last] = 0
        elif expert == last:
            w, b = torch.zeros_like(w), None if b is None else torch.zeros_like(b)
        return w, b
    with unittest.mock.patch.object(inference.MoE, "params", last_expert_zero):
        yield


def moe_expert(moe, e, x):
    """Expert e on x, written out: GELU MLP with biases (gpt) or SwiGLU without (llama)."""
    if moe.swiglu:
        return F.linear(F.silu(F.linear(x, moe.fc_w[e])) * F.linear(x, moe.up_w[e]), moe.proj_w[e])
    return F.linear(F.gelu(F.linear(x, moe.fc_w[e], moe.fc_b[e])), moe.proj_w[e], moe.proj_b[e])


def _inference_run(*args):
    return subprocess.run([sys.executable, "inference.py", *args], cwd=HERE,
                          capture_output=True, text=True, timeout=300)


def inference_cli_cpu():
    with tempfile.TemporaryDirectory() as tmp:
        p = _inference_run(*_INF_TINY, f"--out_dir={tmp}")
        _train_check_ok(p, "inference.py on CPU")
        assert "PyTorch op set only" in p.stdout, p.stdout
        assert "note: dense and moe have random weights" in p.stdout, p.stdout
        for kind in ("dense", "moe"):
            assert f"--- {kind}, seed 0, torch eager: " in p.stdout, p.stdout
        with open(os.path.join(tmp, "inference.json")) as f:
            assert set(json.load(f)["models"]) == {"dense", "moe"}
        p = _inference_run(*_INF_TINY, "--arch=llama", f"--out_dir={tmp}/llama")
        _train_check_ok(p, "inference.py --arch=llama on CPU")
        assert "llama, 2 layers, 32 wide, 2 heads (1 K/V)" in p.stdout, p.stdout
        with open(os.path.join(tmp, "llama", "inference.json")) as f:
            res = json.load(f)
        # 2 layers x (k, v) x 1 K/V head x 24 positions x head size 16 x 4 bytes
        assert res["models"]["dense"]["kv_cache_bytes"] == 2 * 2 * 1 * 24 * 16 * 4, res["models"]["dense"]
        p = _inference_run(*_INF_TINY, "--dtype=fp32,bf16", "--models=dense", f"--out_dir={tmp}/bf16")
        _train_check_ok(p, "inference.py --dtype=fp32,bf16 on CPU")
        assert "dense: decode tok/s bf16 / fp32: torch eager" in p.stdout, p.stdout
        with open(os.path.join(tmp, "bf16", "inference.json")) as f:
            res = json.load(f)["models"]
        assert set(res) == {"dense fp32", "dense bf16", "dense bf16 / fp32"}, set(res)
        # bf16: half the bytes of weights and of KV cache
        assert res["dense bf16"]["kv_cache_bytes"] * 2 == res["dense fp32"]["kv_cache_bytes"], res
        assert res["dense bf16"]["weight_bytes_per_token"] * 2 == res["dense fp32"]["weight_bytes_per_token"], res
    return "gpt and llama, dense and MoE, fp32 and bf16 generate on the PyTorch op set; inference.json written"


def inference_trained_row():
    # where out/ckpt_torch.pt exists, a plain run decodes it after the random models, with its own shape and
    # vocabulary; where it does not, a note says how to get it
    with tempfile.TemporaryDirectory() as tmp:
        p = _train_run(*_train_tiny_args(tmp, "--max_iters=3"))
        _train_check_ok(p, "train.py for a checkpoint")
        tiny = [a for a in _INF_TINY if not a.startswith("--models")] + ["--models=dense,trained", "--prompt=the"]
        p = subprocess.run([sys.executable, os.path.join(HERE, "inference.py"), *tiny], cwd=tmp, capture_output=True,
                           text=True, timeout=300)
        _train_check_ok(p, "inference.py with out/ckpt_torch.pt")
        assert "--- trained, torch eager: " in p.stdout and "--- dense, seed 0" in p.stdout, p.stdout
        assert "trained (gpt, 1 layers, 32 wide, 2 heads (2 K/V), context 16)" in p.stdout, p.stdout
        with open(os.path.join(tmp, "out", "inference.json")) as f:
            assert set(json.load(f)["models"]) == {"dense", "trained"}
        os.remove(os.path.join(tmp, "out", "ckpt_torch.pt"))
        p = subprocess.run([sys.executable, os.path.join(HERE, "inference.py"), *tiny], cwd=tmp, capture_output=True,
                           text=True, timeout=300)
        _train_check_ok(p, "inference.py without out/ckpt_torch.pt")
        assert "note: no trained model: out/ckpt_torch.pt does not exist (python train.py writes it)" in p.stdout, \
            p.stdout
    return "the checkpoint decoded after the random model; without it, a note"


def inference_match_margins():
    # the exact-match line counts the equal picks won by more than NEAR_TIE times the largest logit
    # difference, and calls a first difference a near tie only when its margin is within that
    logits = {("torch", "graph", 0): torch.tensor([[3.0, 1.0, 0.0], [1.0, 0.99, 0.0], [0.0, 2.0, 1.995]])}
    logits["cuda", "graph", 0] = logits["torch", "graph", 0] + torch.tensor([[1e-3, 0, 0], [0, 0, 0], [0, 0, 2e-3]])
    run = lambda name, toks, margins: {"op_set": name, "mode": "graph", "seed": 0, "tokens": toks, "margins": margins}
    for cuda_toks, near in (([0, 0, 2], True), ([1, 0, 2], False)):
        seeds = inference.compare_runs([run("torch", [0, 0, 1], [2.0, 0.01, 0.005])],
                                       [run("cuda", cuda_toks, [2.001, 0.01, 0.003])], logits)
        line, summary = inference.match_line("graph", seeds)
        i = inference.first_difference([0, 0, 1], cuda_toks)
        assert summary["equal_prefix_tokens"] == i, (i, summary)
        assert math.isclose(summary["max_logit_diff"], 2e-3 if near else 1e-3, rel_tol=1e-4), summary
        assert summary["not_near_tie"] == (1 if near else 0), summary  # 2.0 > 10 x diff; 0.01 is not
        assert ("(cuda): a near tie" in line) == near and ("(cuda): NOT a near tie" in line) == (not near), line
    return one_line(line)[:150]


@mutant("every_pick_a_near_tie", "inference/match_margins")
def _every_pick_a_near_tie():
    with unittest.mock.patch.object(inference, "NEAR_TIE", 1e9):
        yield


def _expect_inference_error(args, *words):
    p = _inference_run(*args)
    assert p.returncode != 0, f"{args} was accepted:\n{p.stdout[-1000:]}"
    last = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    assert last.startswith("inference.py: error:"), p.stderr[-1000:]
    for w in words:
        assert w in last, f"message does not name {w!r}: {last}"
    return last


def inference_bad_inputs():
    seen = []
    with tempfile.TemporaryDirectory() as tmp:
        seen.append(_expect_inference_error([*_INF_TINY, "--prompt=Oz \u20ac"], "--prompt", "\u20ac"))
        seen.append(_expect_inference_error([*_INF_TINY, "--prompt=" + "o" * 30], "--prompt", "24"))
        missing = os.path.join(tmp, "nothere.pt")
        seen.append(_expect_inference_error(["--device=cpu", f"--ckpt={missing}"], missing))
        # a real checkpoint, then damaged copies of it
        text = _train_text_file(tmp)
        out = os.path.join(tmp, "out")
        p = _train_run(*_TRAIN_TINY, f"--data_path={text}", f"--out_dir={out}", "--max_iters=3")
        _train_check_ok(p, "train.py for a checkpoint")
        good = os.path.join(out, "ckpt_torch.pt")
        p = _inference_run("--device=cpu", f"--ckpt={good}", "--max_new_tokens=10", "--prompt=the", "--n_layer=5",
                           f"--out_dir={tmp}")
        _train_check_ok(p, "inference.py --ckpt")
        assert "--- trained, torch eager: " in p.stdout, p.stdout
        assert "ignoring --n_layer=5" in p.stdout and "n_layer=1" in p.stdout, p.stdout  # the checkpoint's shape
        assert "random weights" not in p.stdout, p.stdout
        raw = open(good, "rb").read()
        truncated = os.path.join(tmp, "truncated.pt")
        open(truncated, "wb").write(raw[:len(raw) // 2])
        seen.append(_expect_inference_error(["--device=cpu", f"--ckpt={truncated}"], truncated))
        foreign = os.path.join(tmp, "foreign.pt")
        torch.save({"weights": torch.zeros(3)}, foreign)
        seen.append(_expect_inference_error(["--device=cpu", f"--ckpt={foreign}"], foreign))
        other = os.path.join(tmp, "other_config.pt")  # weights intact, config of another model, checksums to match
        ck = torch.load(good, weights_only=True)
        ck["config"]["n_embd"] *= 2
        ck["sha256"] = data.checkpoint_digests(ck)
        torch.save(ck, other)
        seen.append(_expect_inference_error(["--device=cpu", f"--ckpt={other}"], other, "do not fit"))
    return " | ".join(s.replace("inference.py: error: ", "")[:70] for s in seen)


def inference_interrupt_keeps_results():
    # Ctrl-C during the second run: exit 130, one line, and inference.json with the first run in it
    real, calls = inference.run_path, []

    def interrupted_second_time(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    with tempfile.TemporaryDirectory() as tmp:
        out = io.StringIO()
        with unittest.mock.patch.object(inference, "run_path", interrupted_second_time), \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                inference.main([*_INF_TINY, "--models=dense", "--seeds=0,1", f"--out_dir={tmp}"])
                code = 0
            except SystemExit as e:
                code = e.code
        assert code == 130, f"exit {code}:\n{out.getvalue()[-1500:]}"
        assert (f"interrupted by Ctrl-C (SIGINT); the results so far are in {os.path.join(tmp, 'inference.json')}"
                in out.getvalue()), out.getvalue()[-1500:]
        with open(os.path.join(tmp, "inference.json")) as f:
            res = json.load(f)
        assert res["interrupted"] and res["unfinished"]["model"] == "dense", res.keys()
        assert [r["seed"] for r in res["unfinished"]["runs"]] == [0], res["unfinished"]["runs"]
        assert not os.path.exists(os.path.join(tmp, ".inference.lock")), "the lock was left behind"
    return "exit 130; the finished run kept in inference.json"


def inference_sigterm_keeps_results():
    # SIGTERM after the first seed: inference.json already held that seed's run when its line was printed (saved as
    # each run ends), and after the signal holds what finished; exit 143, one line, no lock left
    with tempfile.TemporaryDirectory() as tmp:
        path, seen = os.path.join(tmp, "inference.json"), {}

        def read_file(line):  # what the running process has saved so far
            with open(path) as f:
                seen["runs"] = [r["seed"] for r in json.load(f)["unfinished"]["runs"]]
        cmd = [sys.executable, "-u", "inference.py", *_INF_TINY, "--models=dense",
               "--seeds=" + ",".join(map(str, range(200))), f"--out_dir={tmp}"]
        try:
            proc, _, err = _signal_when(cmd, r"^dense \| seed 0 \|", signal.SIGTERM, before=read_file)
        except FileNotFoundError:
            raise AssertionError("no inference.json while the run went on after its first seed") from None
        assert seen["runs"] == [0], seen
        assert proc.returncode == 143 and "Traceback" not in err, f"exit {proc.returncode}\n{err[-1500:]}"
        assert err.strip().splitlines()[-1] == f"inference.py: interrupted by SIGTERM; the results so far are in {path}"
        with open(path) as f:
            res = json.load(f)
        runs = [r["seed"] for r in res["unfinished"]["runs"]]
        assert res["interrupted"] == "SIGTERM" and runs == list(range(len(runs))) and 1 <= len(runs) < 200, res
        assert os.listdir(tmp) == ["inference.json"], os.listdir(tmp)
    return f"seed 0 saved before its line; SIGTERM: exit 143, {len(runs)} seed(s) kept, no lock"


@mutant("inference_saves_at_model_ends_only", "inference/sigterm_keeps_results")
def _inference_saves_at_model_ends_only():
    """Results written when a model ends, on Ctrl-C or SIGTERM: a run killed before its first model ends keeps none."""
    with planted_in_subprocesses("""
import data
_write = data.write_json
data.write_json = lambda path, obj: None if "unfinished" in obj and "interrupted" not in obj else _write(path, obj)
"""):
        yield


def inference_second_run_beside_first():
    # a second run into the same out_dir keeps the first's results and writes its own beside them, saying where
    with tempfile.TemporaryDirectory() as tmp:
        logs = []
        for models in ("dense", "moe"):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                inference.main([*_INF_TINY, f"--models={models}", f"--out_dir={tmp}"])
            logs.append(out.getvalue())
            if models == "dense":
                with open(os.path.join(tmp, "inference.json"), "rb") as f:
                    first = f.read()
        second = os.path.join(tmp, "inference_2.json")
        assert f"results: {second} ({os.path.join(tmp, 'inference.json')} holds an earlier run's)" in logs[1], logs[1]
        assert f"wrote {second}" in logs[1], logs[1][-1000:]
        with open(os.path.join(tmp, "inference.json"), "rb") as f:
            assert f.read() == first, "the first run's results were replaced"
        with open(second) as f:
            assert set(json.load(f)["models"]) == {"moe"}
    return "inference.json kept, inference_2.json written and named"


@mutant("inference_results_replace_earlier", "inference/second_run_beside_first")
def _inference_results_replace_earlier():
    with unittest.mock.patch.object(data, "unused_path", lambda folder, name: os.path.join(folder, name)):
        yield


def inference_option_typos():
    _expect_inference_error(["--max_new_token=3"], "--max_new_token", "did you mean --max_new_tokens?")
    _expect_inference_error(["--ckpt"], "--ckpt needs a value", "--ckpt=VALUE")


# the drop-in, inference.patched: torch.nn.functional's calls on our ops

def _fake_kernels(calls):
    """Our ops' names over PyTorch's ATen ops (not torch.nn.functional, which patched() replaces), each call
    recorded, with our ops' dtype rules and input checks (bindings.cpp) and their bf16 autocast: what
    inference.patched routes can be checked on the CPU, a call routed wrongly showing a dtype, value or error
    of ours where PyTorch's differ (a bf16 input's fp32 weight taken, a float32 loss from bf16 logits)."""
    aten, f32, bf16, fused = torch.ops.aten, torch.float32, torch.bfloat16, (32,)

    def op(name, fn):
        def call(*args, **kwargs):
            calls.append(name)
            cast = torch.is_autocast_enabled("cpu")  # our ops' own autocast kernels, as on CUDA
            with torch.autocast("cpu", enabled=False):
                return fn(cast, *args, **kwargs)
        return call

    def need(ok, why):
        if not ok:
            raise RuntimeError(f"our op would raise: {why}")

    def linear(cast, x, w, b=None):
        x = x.to(bf16) if cast else x  # a bf16 x takes an fp32 (master) weight and bias, rounded to bf16
        need(w.dtype in (x.dtype, f32) and (b is None or (b.dtype == w.dtype and b.shape == w.shape[:1])), "linear")
        return aten.linear(x, w.to(x.dtype), None if b is None else b.to(x.dtype))

    def norm(f, x, w, b, eps, out_dtype, cast):  # fp32 arithmetic, written in out_dtype (autocast: bf16)
        need(w.dtype == x.dtype and (b is None or b.dtype == x.dtype), "norm")
        return f(x.float(), [x.shape[-1]], w.float(), *([] if b is None else [b.float()]), eps).to(
            out_dtype or (bf16 if cast else x.dtype))

    def softmax(cast, x, out_dtype=None):
        return aten._softmax(x.float(), -1, False).to(out_dtype or (f32 if cast else x.dtype))

    def attention(cast, q, k, v, causal=False, scale=None, mode="fused", dropout_p=0.0, rng=None, salt=0):
        # its causal mask aligns the queries to the last keys; under autocast it returns bf16
        need((q.dtype == k.dtype == v.dtype or cast) and k.shape == v.shape and q.shape[0] == k.shape[0]
             and q.shape[3] == k.shape[3] and q.shape[1] % k.shape[1] == 0, "attention")
        need(mode == "tiled" or q.shape[-1] in fused, "attention: fused head size")
        need(mode == "fused" or q.dtype == f32 or cast, "attention: tiled takes float32")
        if dropout_p:  # the twin's spelled-out attention with our masks
            need(mode == "fused" and rng is not None, "attention: dropout in fused mode, with an rng")
            return train.torch_attention(q.float(), k.float(), v.float(), causal, scale, None, dropout_p, rng,
                                         salt).to(bf16 if cast else q.dtype)
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(k.shape[2] - q.shape[2]) if causal else None
        out = aten.scaled_dot_product_attention(q.float(), k.float(), v.float(), mask, scale=scale,
                                                enable_gqa=q.shape[1] != k.shape[1])
        return out.to(bf16 if cast else q.dtype)

    def cross_entropy(cast, x, t, ignore_index=-100):  # float32 from either dtype; NaN for a target out of range
        need(x.shape[0] > 0 and x.shape[1] > 0 and t.dtype == torch.long and isinstance(ignore_index, int),
             "cross_entropy")
        bad = (t != ignore_index) & ((t < 0) | (t >= x.shape[1]))
        loss = aten.cross_entropy_loss(x.float(), t.masked_fill(bad, 0), ignore_index=ignore_index)
        return torch.where(bad.any(), math.nan, loss)  # no branch on the data: traced graphs call it too

    def embedding(cast, idx, w, padding_idx=None):  # padding_idx's row: no gradient
        V = w.shape[0]
        need(padding_idx is None or -V <= padding_idx < V, "embedding: padding_idx")
        return aten.embedding(w, idx, -1 if padding_idx is None else padding_idx % V)

    def gelu(cast, x, approximate="none"):
        if approximate not in ("none", "tanh"):
            raise ValueError("our gelu: approximate must be 'none' or 'tanh'")
        return aten.gelu(x.float(), approximate=approximate).to(x.dtype)

    def swiglu(cast, a, b):  # in fp32, rounded once
        need(a.dtype == b.dtype and a.shape == b.shape, "swiglu")
        return (aten.silu(a.float()) * b.float()).to(a.dtype)

    def rope(cast, x, cos, sin):  # float32 tables (T, D/2), constant
        need(x.dim() == 4 and x.shape[3] % 2 == 0 and cos.dtype == sin.dtype == f32 and not cos.requires_grad
             and not sin.requires_grad and cos.shape == sin.shape == (x.shape[2], x.shape[3] // 2), "rope")
        return train.torch_rope(x.float(), cos, sin).to(x.dtype)

    return types.SimpleNamespace(
        LIMITS={"fused_head_sizes": fused},
        linear=op("linear", linear),
        layernorm=op("layernorm", lambda cast, x, w, b, eps, out_dtype=None: norm(
            aten.layer_norm, x, w, b, eps, out_dtype, cast)),
        rmsnorm=op("rmsnorm", lambda cast, x, w, eps, out_dtype=None: norm(
            aten.rms_norm, x, w, None, eps, out_dtype, cast)),
        gelu=op("gelu", gelu),
        silu=op("silu", lambda cast, x: aten.silu(x.float()).to(x.dtype)),
        swiglu=op("swiglu", swiglu),
        rope=op("rope", rope),
        embedding=op("embedding", embedding),
        softmax=op("softmax", softmax),
        dropout=op("dropout", lambda cast, x, p, rng, salt=0: train.torch_dropout(x, p, rng, salt)),
        attention=op("attention", attention),
        cross_entropy=op("cross_entropy", cross_entropy))


class _DropoutBlock(torch.nn.Module):
    """nanoGPT's block with its dropout: nn.Dropout on the input and on the attention's and MLP's outputs, and
    SDPA's dropout_p on the probabilities while training."""

    def __init__(self, width=64, heads=2, p=0.2):
        super().__init__()
        self.heads, self.p = heads, p
        self.ln1, self.ln2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv, self.proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.fc, self.out = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)
        self.drop, self.resid_drop, self.mlp_drop = (torch.nn.Dropout(p) for _ in range(3))

    def forward(self, x):
        B, T, C = x.shape
        x = self.drop(x)
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True)
        x = x + self.resid_drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))
        return x + self.mlp_drop(self.out(F.gelu(self.fc(self.ln2(x)))))


def run_patched_dropout(kernels, dev):
    """_DropoutBlock trained under inference.patched(kernels): every call of the step ours (dropout and SDPA's
    dropout_p included), masks drawn from PyTorch's generator (a seed repeats them, the next call draws
    others), gradients through them; in eval mode the output is PyTorch's; F.dropout's values 0 or 1 / (1 - p)
    at a dropped fraction within 6 sigma of p."""
    torch.manual_seed(0)
    net, x = _DropoutBlock().to(dev), torch.randn(2, 16, 64, device=dev)
    net.eval()
    want_eval = net(x)
    net.train()
    p, n = 0.25, 256 * 256
    with inference.patched(kernels, device_type=dev.type) as counts:
        torch.manual_seed(1)
        y1 = net(x)
        torch.manual_seed(1)
        y2 = net(x)
        y3 = net(x)
        y1.square().mean().backward()
        ones = F.dropout(torch.ones(256, 256, device=dev), p)
        kept = torch.ones(3, device=dev)
        assert F.dropout(kept, 0.0) is kept, "p = 0: not the input itself, as PyTorch's returns it"
        training_counts = dict(counts)
        net.eval()
        got_eval = net(x)
    torch_calls = {k: v for k, v in training_counts.items() if k[1] == "torch"}
    assert not torch_calls, f"training calls on PyTorch's kernels: {torch_calls}"
    assert training_counts[("dropout", "ours")] == 3 * 3 + 2, training_counts
    assert training_counts[("scaled_dot_product_attention", "ours")] == 3, training_counts
    assert torch.equal(y1, y2), "one generator state drew two masks"
    assert not torch.equal(y1, y3), "the generator did not advance: the next call drew the same masks"
    grads = [q.grad for q in net.parameters()]
    assert all(g is not None and g.isfinite().all() for g in grads), "a parameter got no or a non-finite gradient"
    check("eval", got_eval, want_eval, 1e-5)
    dropped = (ones == 0).float().mean().item()
    scale = torch.tensor(1 / (1 - p), dtype=torch.float32).item()
    assert set(ones.unique().tolist()) <= {0.0, scale}, f"values {ones.unique().tolist()[:5]}, not 0 or {scale}"
    assert abs(dropped - p) <= 6 * math.sqrt(p * (1 - p) / n), f"dropped {dropped:.4f}, p = {p}"
    calls = sum(v for k, v in training_counts.items())
    return f"{calls} training calls, all ours; F.dropout dropped {dropped:.4f} at p = {p}"


def inference_patched_dropout():
    # on the CPU, our ops as _fake_kernels (dropout and attention through the twins' masks)
    return run_patched_dropout(_fake_kernels([]), torch.device("cpu"))


def inference_gpu_patched_dropout():
    return run_patched_dropout(kernels, torch.device(DEV))


def inference_patched_routes():
    # inference.patched sends torch.nn.functional's calls to our ops where their arguments are supported and to
    # PyTorch's where not, counts both, gives the same values, and puts torch.nn.functional back after
    calls, before = [], {n: getattr(F, n) for n in ("linear", "layer_norm", "softmax", "cross_entropy")}
    torch.manual_seed(0)
    model, idx = _FunctionalGPT(), torch.randint(0, 48, (3, 32))
    want = model(idx, idx)
    x, t = torch.randn(6, 48), torch.randint(0, 48, (6,))
    t_ignored = t.clone()
    t_ignored[2] = -100
    qkv, w64 = torch.randn(3, 1, 2, 5, 32), torch.randn(7, 48).double()

    def unsupported_calls():  # each with an argument our ops do not take: PyTorch's, values unchanged
        return [F.softmax(x, dim=0), F.cross_entropy(x, t, label_smoothing=0.1),
                F.scaled_dot_product_attention(*qkv, attn_mask=torch.ones(5, 5).bool()),
                F.layer_norm(x, (48,)), F.linear(x.double(), w64),
                F.layer_norm(x.bfloat16(), (48,), torch.ones(48), torch.zeros(48))]  # mixed dtypes
    want_unsupported, want_ignored = unsupported_calls(), F.cross_entropy(x, t_ignored)
    with inference.patched(_fake_kernels(calls), device_type="cpu") as counts:
        got = model(idx, idx)
        unsupported = unsupported_calls()
        ignored = F.cross_entropy(x, t_ignored)  # ours: the ignored target skipped on the device, as PyTorch's
        # a traced graph's tensors have no data, and ours read none: the call is ours too, not counted
        # (AOTAutograd re-runs Dynamo's graph, which calls F.cross_entropy by name)
        eager_calls = len(calls)
        with torch._subclasses.fake_tensor.FakeTensorMode():
            traced = F.cross_entropy(torch.randn(6, 48), torch.randint(0, 48, (6,)))
    check("loss", got, want, 1e-6)
    check("loss_ignored_target", ignored, want_ignored, 1e-6)
    assert type(traced).__name__ == "FakeTensor", type(traced)
    assert all(getattr(F, n) is f for n, f in before.items()), "torch.nn.functional was not put back"
    layers = 2
    expect = {("embedding", "ours"): 2, ("layer_norm", "ours"): 2 * layers + 1, ("linear", "ours"): 4 * layers + 1,
              ("scaled_dot_product_attention", "ours"): layers, ("gelu", "ours"): layers, ("cross_entropy", "ours"): 2,
              ("softmax", "torch"): 1, ("cross_entropy", "torch"): 1, ("scaled_dot_product_attention", "torch"): 1,
              ("layer_norm", "torch"): 2, ("linear", "torch"): 1}
    assert dict(counts) == expect, f"counts {dict(counts)}"
    assert calls[eager_calls:] == ["cross_entropy"], f"the traced call went to {calls[eager_calls:]} of our ops"
    assert len(calls) == 1 + sum(n for (_, way), n in expect.items() if way == "ours"), calls
    for k, (u, want_u) in enumerate(zip(unsupported, want_unsupported, strict=True)):
        assert torch.equal(u, want_u), f"unsupported call {k} changed its value under patched()"
    total = sum(counts.values())
    return f"{total} calls: {len(calls)} on our ops, {total - len(calls)} on PyTorch's; same loss"


def _patched_calls(dev):
    """The calls inference.patched must route right, as (label, route: "ours" or "torch", autocast dtype or None,
    device type it runs on or None for any, call): calls our ops take, and calls left to PyTorch's because
    ours would give another dtype, shape, value or error. Tensors are drawn once: a call runs twice on the
    same inputs, patched and not. CPU autocast leaves a bf16 norm or softmax in bf16 where CUDA's writes
    float32 (its lists differ): those run on CUDA only. An out-of-range target is ours and gives NaN where
    PyTorch's raises (inference/patched_cross_entropy_bad_target)."""
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16

    def r(*shape, dtype=f32):
        return torch.randn(*shape, device=dev).to(dtype)
    x, w, b, g, c = r(6, 64), r(48, 64), r(48), r(64), r(64)
    xb, wb, bb, gb, cb = (u.to(bf16) for u in (x, w, b, g, c))
    xt = r(64, 6).t()  # a transposed view, not contiguous
    q, k, v, k2, v2, k3 = r(2, 4, 5, 32), r(2, 4, 5, 32), r(2, 4, 5, 32), r(2, 2, 5, 32), r(2, 2, 5, 32), r(2, 3, 5, 32)
    qb, kb, vb = (u.to(bf16) for u in (q, k, v))
    q48, k48, v48, v16 = r(2, 4, 5, 48), r(2, 4, 5, 48), r(2, 4, 5, 48), r(2, 4, 5, 16)  # 48: not fused, tiled
    qs, ks, vs = (u.view(2, 5, 4, 32).transpose(1, 2) for u in r(2, 5, 3 * 128).split(128, -1))  # heads of one view
    idx, table = torch.randint(0, 48, (2, 5), device=dev), r(48, 64)
    logits, t = r(6, 48), torch.randint(0, 48, (6,), device=dev)
    t_ignored, t_five, t_none = t.clone(), t.clone(), torch.full_like(t, -100)
    t_ignored[2], t_ignored[5], t_five[1] = -100, -100, 5
    return [
        ("linear fp32", "ours", None, None, lambda: F.linear(x, w, b)),
        ("linear bf16", "ours", None, None, lambda: F.linear(xb, wb, bb)),
        ("linear 1-D input", "ours", None, None, lambda: F.linear(x[0], w, b)),
        ("linear transposed input", "ours", None, None, lambda: F.linear(xt, w, b)),
        ("linear bf16 input, fp32 weight", "torch", None, None, lambda: F.linear(xb, w, b)),
        ("linear fp32 input, bf16 weight", "torch", None, None, lambda: F.linear(x, wb, bb)),
        ("linear bf16 bias, fp32 weight", "torch", None, None, lambda: F.linear(x, w, bb)),
        ("linear broadcast bias", "torch", None, None, lambda: F.linear(x, w, b[:1])),
        ("linear float64", "torch", None, None, lambda: F.linear(x.double(), w.double())),
        ("linear fp32, autocast", "ours", bf16, None, lambda: F.linear(x, w, b)),
        ("linear bf16 input, fp32 weight, autocast", "ours", bf16, None, lambda: F.linear(xb, w, b)),
        ("linear bf16 weight, fp32 bias, autocast", "torch", bf16, None, lambda: F.linear(x, wb, b)),
        ("linear fp32, float16 autocast", "torch", f16, None, lambda: F.linear(x, w, b)),
        ("layer_norm fp32", "ours", None, None, lambda: F.layer_norm(x, (64,), g, c)),
        ("layer_norm bf16", "ours", None, None, lambda: F.layer_norm(xb, (64,), gb, cb)),
        ("layer_norm transposed input", "ours", None, None, lambda: F.layer_norm(xt, (64,), g, c)),
        ("layer_norm 1-D input", "ours", None, None, lambda: F.layer_norm(x[0], [64], g, c, 1e-3)),
        ("layer_norm no weights", "torch", None, None, lambda: F.layer_norm(x, (64,))),
        ("layer_norm bf16 input, fp32 weights", "torch", None, None, lambda: F.layer_norm(xb, (64,), g, c)),
        ("layer_norm over two dims", "torch", None, None,
         lambda: F.layer_norm(x.view(2, 3, 64), (3, 64), g.expand(3, 64), c.expand(3, 64))),
        ("layer_norm int shape", "torch", None, None, lambda: F.layer_norm(x, 64, g, c)),
        ("layer_norm fp32, autocast", "ours", bf16, None, lambda: F.layer_norm(x, (64,), g, c)),
        ("layer_norm bf16, autocast", "ours", bf16, "cuda", lambda: F.layer_norm(xb, (64,), gb, cb)),
        ("rms_norm fp32, default eps", "ours", None, None, lambda: F.rms_norm(x * 3e-4, (64,), g)),  # x^2 ~ eps
        ("rms_norm bf16", "ours", None, None, lambda: F.rms_norm(xb, (64,), gb, 1e-6)),
        ("rms_norm no weight", "torch", None, None, lambda: F.rms_norm(x, (64,))),
        ("rms_norm fp32 input, bf16 weight", "torch", None, None, lambda: F.rms_norm(x, (64,), gb)),
        ("rms_norm fp32, autocast", "ours", bf16, None, lambda: F.rms_norm(x, (64,), g)),
        ("rms_norm bf16, autocast", "ours", bf16, "cuda", lambda: F.rms_norm(xb, (64,), gb)),
        ("gelu fp32 tanh", "ours", None, None, lambda: F.gelu(x, approximate="tanh")),
        ("gelu bf16", "ours", None, None, lambda: F.gelu(xb)),
        ("gelu unknown approximate", "torch", None, None, lambda: F.gelu(x, approximate="exact")),
        ("silu bf16", "ours", None, None, lambda: F.silu(xb)),
        ("silu in place", "torch", None, None, lambda: F.silu(x.clone(), inplace=True)),
        ("embedding fp32", "ours", None, None, lambda: F.embedding(idx, table)),
        ("embedding bf16", "ours", None, None, lambda: F.embedding(idx, table.to(bf16))),
        ("embedding int32 indices", "torch", None, None, lambda: F.embedding(idx.int(), table)),
        ("embedding padding_idx", "ours", None, None, lambda: F.embedding(idx, table, padding_idx=int(idx[0, 0]))),
        ("embedding negative padding_idx", "ours", None, None, lambda: F.embedding(idx, table, padding_idx=-48)),
        ("embedding padding_idx out of range", "torch", None, None, lambda: F.embedding(idx, table, padding_idx=48)),
        ("embedding max_norm", "torch", None, None, lambda: F.embedding(idx, table.clone(), max_norm=1.0)),
        ("softmax last dim", "ours", None, None, lambda: F.softmax(x, -1)),
        ("softmax 1-D", "ours", None, None, lambda: F.softmax(x[0], 0)),
        ("softmax bf16 to fp32", "ours", None, None, lambda: F.softmax(xb, -1, dtype=f32)),
        ("softmax fp32 to bf16", "torch", None, None, lambda: F.softmax(x, -1, dtype=bf16)),
        ("softmax first dim", "torch", None, None, lambda: F.softmax(x, 0)),
        ("softmax of a scalar", "torch", None, None, lambda: F.softmax(x[0, 0], -1)),
        ("softmax fp32, autocast", "ours", bf16, None, lambda: F.softmax(x, -1)),
        ("softmax bf16, autocast", "ours", bf16, "cuda", lambda: F.softmax(xb, -1)),
        ("sdpa fp32", "ours", None, None, lambda: F.scaled_dot_product_attention(q, k, v)),
        ("sdpa bf16 causal", "ours", None, None, lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True)),
        ("sdpa head size 48", "ours", None, None, lambda: F.scaled_dot_product_attention(q48, k48, v48)),
        ("sdpa grouped heads", "ours", None, None, lambda: F.scaled_dot_product_attention(q, k2, v2, enable_gqa=True)),
        ("sdpa scale", "ours", None, None, lambda: F.scaled_dot_product_attention(q, k, v, scale=0.3)),
        ("sdpa heads as strided views", "ours", None, None, lambda: F.scaled_dot_product_attention(qs, ks, vs)),
        ("sdpa v's own head size", "torch", None, None, lambda: F.scaled_dot_product_attention(q, k, v16)),
        ("sdpa k, v broadcast over the batch", "torch", None, None,
         lambda: F.scaled_dot_product_attention(q, k[:1], v[:1])),
        ("sdpa one k, v head broadcast", "torch", None, None,
         lambda: F.scaled_dot_product_attention(q, k[:, :1], v[:, :1])),
        ("sdpa causal, Sq != Sk", "torch", None, None,
         lambda: F.scaled_dot_product_attention(q[:, :, :3], k, v, is_causal=True)),
        ("sdpa heads not dividing", "torch", None, None,
         lambda: F.scaled_dot_product_attention(q, k3, k3, enable_gqa=True)),
        ("sdpa mixed dtypes", "torch", None, None, lambda: F.scaled_dot_product_attention(q, kb, v)),
        ("sdpa bf16 head size 48", "torch", None, None,
         lambda: F.scaled_dot_product_attention(q48.to(bf16), k48.to(bf16), v48.to(bf16))),
        ("sdpa mask", "torch", None, None,
         lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(5, 5, dtype=torch.bool, device=dev))),
        ("sdpa no keys", "torch", None, None, lambda: F.scaled_dot_product_attention(q, k[:, :, :0], v[:, :, :0])),
        ("sdpa 3-D", "torch", None, None, lambda: F.scaled_dot_product_attention(q[0], k[0], v[0])),
        ("sdpa fp32, autocast", "ours", bf16, None, lambda: F.scaled_dot_product_attention(q, k, v)),
        ("sdpa mixed dtypes, autocast", "ours", bf16, None, lambda: F.scaled_dot_product_attention(q, kb, v)),
        ("cross_entropy fp32", "ours", None, None, lambda: F.cross_entropy(logits, t)),
        ("cross_entropy bf16", "ours", None, None, lambda: F.cross_entropy(logits.to(bf16), t)),
        ("cross_entropy bf16, autocast", "ours", bf16, None, lambda: F.cross_entropy(logits.to(bf16), t)),
        ("cross_entropy empty batch", "torch", None, None, lambda: F.cross_entropy(logits[:0], t[:0])),
        ("cross_entropy ignored targets", "ours", None, None, lambda: F.cross_entropy(logits, t_ignored)),
        ("cross_entropy ignore_index 5", "ours", None, None, lambda: F.cross_entropy(logits, t_five, ignore_index=5)),
        ("cross_entropy every target ignored", "ours", None, None, lambda: F.cross_entropy(logits, t_none)),
        ("cross_entropy ignored targets bf16, autocast", "ours", bf16, None,
         lambda: F.cross_entropy(logits.to(bf16), t_ignored)),
        ("cross_entropy int32 targets", "torch", None, None, lambda: F.cross_entropy(logits, t.int())),
        ("cross_entropy class probabilities", "torch", None, None,
         lambda: F.cross_entropy(logits, torch.softmax(logits, -1))),
        ("cross_entropy label smoothing", "torch", None, None, lambda: F.cross_entropy(logits, t, label_smoothing=0.1)),
        ("cross_entropy sum", "torch", None, None, lambda: F.cross_entropy(logits, t, reduction="sum")),
    ]


# Ours against PyTorch's result, not float64 (the cases print the largest err/tol by dtype). fp32: sums of 64
# unit-normal terms round near 1e-6 on either side, so 1e-5 leaves 10x and still fails single-pass TF32
# (~1e-3); bf16: outputs rounded on both sides after arithmetic that differs below an ulp (bf16 P in
# attention, PyTorch's bf16 log-softmax in its loss) differ by an ulp (2^-8 of the value): 4 ulps and 1e-2.
# Other dtypes are PyTorch's on both sides: exact.
PATCHED_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 2**-6)}


def run_patched_calls(kernels, dev, calls=None, block=None):
    """calls (default _patched_calls(dev)) under block(kernels) (default inference.patched): each call's route
    must be the one wanted, and its result PyTorch's dtype and shape with values within PATCHED_TOL, or the
    exception type PyTorch's raises. Returns a summary: the calls by route and the largest error over tolerance by
    dtype."""
    def outcome(call, autocast):
        with torch.autocast(dev.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            try:
                return call()
            except Exception as e:
                return e
    calls = [row for row in calls or _patched_calls(dev) if row[3] in (None, dev.type)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTorch's own, about mixed dtypes
        refs = [outcome(call, ac) for _, _, ac, _, call in calls]
        with (block or inference.patched)(kernels, device_type=dev.type) as counts:  # counts before and after each
            runs = [(counts.copy(), outcome(call, ac), counts.copy()) for _, _, ac, _, call in calls]
    worst, raised, routes = collections.defaultdict(float), 0, collections.Counter()
    for (label, want, ac, *_), ref, (before, got, after) in zip(calls, refs, runs, strict=True):
        taken = [way for (_, way), n in (after - before).items() for _ in range(n)]
        assert taken, f"{label}: the route raised {type(got).__name__} ({one_line(got)[:100]}), expected {want}"
        assert taken == [want], f"{label}: routed to {taken}, expected {want}"
        routes[want] += 1
        if isinstance(ref, Exception) or isinstance(got, Exception):
            assert type(got) is type(ref), f"{label}: {type(got).__name__} ({one_line(got)[:100]}) where " \
                f"PyTorch's gives {type(ref).__name__} ({one_line(ref)[:100]})"
            raised += 1
            continue
        assert (got.dtype, got.shape) == (ref.dtype, ref.shape), \
            f"{label}: {got.dtype} {tuple(got.shape)} where PyTorch's gives {ref.dtype} {tuple(ref.shape)}"
        atol, rtol = PATCHED_TOL.get(torch.bfloat16 if ac is not None else ref.dtype, (0.0, 0.0))
        got, ref, dtype = got.detach().double(), ref.detach().double(), ref.dtype
        err = torch.where(got.isnan() & ref.isnan(), 0.0, (got - ref).abs())  # NaN where one side alone is
        tol = atol + rtol * ref.abs().nan_to_num(0.0)
        assert (err <= tol).all(), f"{label}: max|ours - PyTorch's| {err.max().item():.2e} > {atol}+{rtol:.0e}|ref|"
        if atol and err.numel():
            worst[dtype] = max(worst[dtype], (err / tol).max().item())
    return (f"{len(calls)} calls: {routes['ours']} on our ops, {routes['torch']} on PyTorch's ({raised} raising as "
            f"PyTorch's do); max err/tol " + ", ".join(f"{str(d)[6:]} {e:.2f}" for d, e in worst.items()))


def inference_patched_calls():
    # every call of _patched_calls on the CPU, our ops as _fake_kernels (our dtype rules and checks on ATen)
    return run_patched_calls(_fake_kernels([]), torch.device("cpu"))


def inference_gpu_patched_calls():
    # the same calls on CUDA tensors and our kernels: routes, dtypes, shapes, values, errors against PyTorch's
    if torch.cuda.get_device_capability() != (9, 0):
        raise Skip("the table's bf16 products are ours on Hopper's wgmma alone (compute capability 9.0)")
    return run_patched_calls(kernels, torch.device(DEV))


def _bad_target_batch(dev):
    """Logits (6, 48) and targets with one out of range (48, row 3) and one ignored (-100, row 1)."""
    logits, t = torch.randn(6, 48, device=dev), torch.randint(0, 48, (6,), device=dev)
    t[1], t[3] = -100, 48
    return logits, t


def inference_patched_cross_entropy_bad_target():
    # under inference.patched a target out of range (not ignore_index) is ours: a NaN loss, where PyTorch's raises
    # (on the CPU an IndexError; on CUDA a device-side assert that leaves the process's CUDA unusable)
    logits, t = _bad_target_batch("cpu")
    with inference.patched(_fake_kernels([]), device_type="cpu") as counts:
        loss = F.cross_entropy(logits, t)
    assert dict(counts) == {("cross_entropy", "ours"): 1}, f"counts {dict(counts)}"
    assert loss.isnan(), f"loss {loss.item()}, not NaN"
    return "ours: NaN"


def inference_gpu_patched_cross_entropy_bad_target():
    # on our kernels the NaN loss comes with the mailbox's ValueError. The route is called itself, not through
    # patched(): a fallback would run PyTorch's kernel, whose device-side assert would end this process's CUDA.
    logits, t = _bad_target_batch(DEV)
    loss = inference._functional_routes(kernels, "cuda")["cross_entropy"](logits, t)
    assert loss is not NotImplemented, "the route sends a target out of range to PyTorch's (a device-side assert)"
    assert loss.isnan(), f"loss {loss.item()}, not NaN"
    return one_line(expect_index_error(kernels.check_errors, "cross_entropy", "targets", 48, 48))


# Planted faults in inference.patched's routes: patched() asks _functional_routes for them when entered.

def _route_fault(name, when, ours):
    """A mutant's plant: patched()'s route for torch.nn.functional.<name> sends the calls where when(*args,
    **kwargs) holds to ours(kernels, *args, **kwargs), our op, whatever its arguments."""
    real = inference._functional_routes

    def routes(kernels, device_type):
        r = real(kernels, device_type)
        decide = r[name]
        r[name] = lambda *a, **kw: ours(kernels, *a, **kw) if when(*a, **kw) else decide(*a, **kw)
        return r
    with unittest.mock.patch.object(inference, "_functional_routes", routes):
        yield


@mutant("patched_dropout_reuses_one_rng", "inference/patched_dropout", "inference/gpu_patched_dropout")
def _patched_dropout_reuses_one_rng():
    # patched()'s dropout takes one fixed {seed, offset}, not a fresh draw of PyTorch's generator per call
    with unittest.mock.patch.object(torch.Tensor, "random_", lambda self, *a, **kw: self.fill_(12345)):
        yield


@mutant("patched_routes_to_pytorch", "inference/patched_routes", "inference/patched_calls", "readme/patched_example",
        "inference/gpu_patched_compiled_gpt", "inference/gpu_patched_calls", "inference/patched_dropout",
        "readme/hf_example", "readme/gpu_hf_example", "inference/hf_generate_llama", "inference/hf_generate_gpt2")
def _mutant_patched_routes_to_pytorch():
    real = inference._functional_routes
    with unittest.mock.patch.object(inference, "_functional_routes", lambda *args: {
            name: lambda *a, **kw: NotImplemented for name in real(*args)}):
        yield


def _autocast_of(t):
    return torch.is_autocast_enabled(t.device.type)


def _our_sdpa(kernels, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return kernels.attention(q, k, v, causal=is_causal, scale=scale,
                             mode="fused" if q.shape[-1] in kernels.LIMITS["fused_head_sizes"] else "tiled")


def _our_linear(kernels, x, w, b=None):
    return kernels.linear(x, w, b)


def _our_cross_entropy(kernels, x, t, **kwargs):
    return kernels.cross_entropy(x, t)


# (mutant, route, the calls it sends to our op, our op's call): each undoes one of the routes' refusals
ROUTE_FAULTS = [
    ("patched_sdpa_value_head_size", "scaled_dot_product_attention",
     lambda q, k, v, **kw: v.shape[-1] != k.shape[-1], _our_sdpa),
    ("patched_sdpa_batch_broadcast", "scaled_dot_product_attention",
     lambda q, k, v, **kw: k.shape[0] != q.shape[0], _our_sdpa),
    ("patched_sdpa_mixed_dtypes", "scaled_dot_product_attention",
     lambda q, k, v, **kw: q.dtype != k.dtype and not _autocast_of(q), _our_sdpa),
    ("patched_linear_mixed_dtypes", "linear", lambda x, w, b=None: x.dtype != w.dtype and not _autocast_of(x),
     _our_linear),
    ("patched_linear_bias_broadcast", "linear", lambda x, w, b=None: b is not None and b.shape != w.shape[:1],
     _our_linear),
    ("patched_float16_autocast", "linear",
     lambda x, w, b=None: _autocast_of(x) and torch.get_autocast_dtype(x.device.type) == torch.float16, _our_linear),
    ("patched_norm_bf16_under_autocast", "layer_norm", lambda x, *a, **kw: _autocast_of(x),
     lambda kernels, x, shape, w=None, b=None, eps=1e-5: kernels.layernorm(x, w, b, eps)),
    ("patched_softmax_to_bf16", "softmax", lambda x, dim=None, _stacklevel=3, dtype=None: dtype == torch.bfloat16,
     lambda kernels, x, dim=None, _stacklevel=3, dtype=None: kernels.softmax(x, out_dtype=dtype)),
    ("patched_cross_entropy_fp32_loss", "cross_entropy",
     lambda x, t, **kw: x.dtype == torch.bfloat16 and not kw and len(x) > 0 and not _autocast_of(x),
     _our_cross_entropy),
    ("patched_cross_entropy_empty_batch", "cross_entropy", lambda x, t, **kw: len(x) == 0, _our_cross_entropy),
    ("patched_embedding_padding_idx_out_of_range", "embedding",
     lambda idx, w, padding_idx=None, **kw: padding_idx is not None and not -len(w) <= padding_idx < len(w),
     lambda kernels, idx, w, padding_idx=None, **kw: kernels.embedding(idx, w, padding_idx=padding_idx)),
]
for _name, _route, _when, _ours in ROUTE_FAULTS:
    mutant(_name, "inference/patched_calls", "inference/gpu_patched_calls")(
        functools.partial(_route_fault, _route, _when, _ours))


def _route_to_pytorch(name, when):
    """A mutant's plant: patched()'s route for torch.nn.functional.<name> sends the calls where when(*args,
    **kwargs) holds to PyTorch's, as the routes did before they took them."""
    real = inference._functional_routes

    def routes(kernels, device_type):
        r = real(kernels, device_type)
        decide = r[name]
        r[name] = lambda *a, **kw: NotImplemented if when(*a, **kw) else decide(*a, **kw)
        return r
    with unittest.mock.patch.object(inference, "_functional_routes", routes):
        yield


def _eager_targets(f):
    """when(x, t, ...) for _route_to_pytorch: f(x, t, ignore_index) on an eager call's data (a traced call has none)."""
    return lambda x, t, *a, ignore_index=-100, **kw: (torch.is_tensor(t) and not inference.tracing(x, t)
                                                     and bool(f(x, t, ignore_index).any()))


# (mutant, route, the calls it sends to PyTorch's, the cases that catch it): each undoes one of the routes' takings
ROUTES_TO_PYTORCH = [
    ("patched_cross_entropy_ignored_to_pytorch", "cross_entropy", _eager_targets(lambda x, t, i: t == i),
     ("inference/patched_calls", "inference/patched_routes", "inference/gpu_patched_calls")),
    ("patched_cross_entropy_bad_target_to_pytorch", "cross_entropy",
     _eager_targets(lambda x, t, i: ((t < 0) | (t >= x.shape[-1])) & (t != i)),
     ("inference/patched_cross_entropy_bad_target", "inference/gpu_patched_cross_entropy_bad_target")),
    ("patched_cross_entropy_not_traced", "cross_entropy", lambda *a, **kw: inference.tracing(*a, *kw.values()),
     ("inference/patched_routes", "inference/gpu_patched_compiled_gpt", "readme/patched_example")),
    ("patched_embedding_padding_idx_to_pytorch", "embedding",
     lambda idx, w, padding_idx=None, **kw: padding_idx is not None,
     ("inference/patched_calls", "inference/patched_routes", "inference/gpu_patched_calls")),
]
for _name, _route, _when, _catchers in ROUTES_TO_PYTORCH:
    mutant(_name, *_catchers)(functools.partial(_route_to_pytorch, _route, _when))


# Our forward kernel of each function inference.patched keeps on ours in a compiled model, as the profiler
# names it: ours are in the global namespace (kernels.cu), PyTorch's in at::native, whose elementwise_kernel
# shares our name.
PATCHED_KERNELS = {"embedding": "embedding_fwd_kernel", "layer_norm": "layernorm_fwd_kernel",
                   "linear": r"(matmul\w*|gemv)_kernel", "gelu": "elementwise_kernel<ActFwd<Gelu",
                   "scaled_dot_product_attention": r"attention_fwd\w*_kernel",
                   "cross_entropy": "cross_entropy_fwd_kernel"}


def our_launches(fn, functions):
    """Runs fn() under the profiler; asserts that for each of the functions our forward kernel was launched
    (PyTorch's computing the same values would pass a check of values alone). Returns how many launches of
    kernels.cu's kernels were seen."""
    names = launched_kernels(fn)
    if not names:  # not even PyTorch's own: the profiler saw nothing (e.g. under compute-sanitizer)
        raise Skip("the profiler recorded no CUDA kernel, so the route taken cannot be read from their names")
    ours = set(our_kernel_names())
    mine = [(m.group(1), n) for n in names if (m := re.match(r"(?:void )?(\w+)[<(]", n)) and m.group(1) in ours]
    missing = [f for f in functions if not any(re.match(rf"(?:void )?{PATCHED_KERNELS[f]}", n) for _, n in mine)]
    assert not missing, f"no kernel of ours ran for {missing}; ours that ran: {sorted({k for k, _ in mine})}"
    return len(mine)


def readme_patched_example():
    # the README's example of our ops in another model runs as printed (its code block, executed), on our kernels
    if UNDER_SANITIZER:
        raise Skip("under compute-sanitizer: Inductor compiling outlasts a sweep")
    text = open(os.path.join(HERE, "README.md")).read()
    block = text.split("**In your own model.**", 1)[1].split("\n\n    import torch", 1)[1]
    code = "    import torch" + block.split("\n\n", 1)[0]
    code = "\n".join(line[4:] for line in code.splitlines())
    out = io.StringIO()
    # the bf16 products are ours on Hopper only
    functions = ("embedding", "layer_norm", "gelu", "cross_entropy") + \
        ("linear",) * (torch.cuda.get_device_capability() == (9, 0))
    with contextlib.redirect_stdout(out):
        launches = our_launches(lambda: exec(compile(code, "README.md", "exec"), {}), functions)
    loss = float(out.getvalue().split()[0])
    assert math.isfinite(loss) and loss < math.log(96) + 1, out.getvalue()
    return f"printed {one_line(out.getvalue())[:120]}; {launches} launches of our kernels"


def run_readme_hf_example(dev):
    """The README's Hugging Face example run as printed (on the CPU: our ops as _fake_kernels, the tensors on the
    CPU), its counts all ours, each swapped kind of call among them."""
    _transformers()
    text = open(os.path.join(HERE, "README.md")).read()
    block = text.split("A Hugging Face model takes both blocks", 1)[1].split("\n\n    import torch", 1)[1]
    code = "\n".join(line[4:] for line in ("    import torch" + block.split("\n\n", 1)[0]).splitlines())
    scope = {}
    if dev == "cpu":
        scope["fake"] = _fake_kernels([])
        for a, b in ((".cuda()", ""), ('device="cuda"', 'device="cpu"'),
                     ("inference.patched()", "inference.patched(fake, device_type='cpu')"),
                     ("inference.apply_kernels(model)", "inference.apply_kernels(model, fake, device_type='cpu')")):
            assert a in code, f"the README's example has no {a!r}"
            code = code.replace(a, b)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), scope)
    counts = scope["calls"] + scope["modules"]
    assert counts and all(way == "ours" for _, way in counts), f"calls on PyTorch's: {dict(counts)}"
    want = {"linear", "LlamaRMSNorm", "LlamaMLP", "apply_rotary_pos_emb", "scaled_dot_product_attention",
            "embedding", "cross_entropy"}
    assert {name for name, _ in counts} == want, f"calls {dict(counts)}"
    return f"printed {one_line(out.getvalue())[:150]}"


add("readme/hf_example", run_readme_hf_example, "cpu", gpu=False)
add("readme/gpu_hf_example", run_readme_hf_example, DEV)


def inference_gpu_patched_compiled_gpt():
    # a GPT written on torch.nn.functional trains on our kernels under inference.patched and
    # torch.compile(fullgraph=True), its losses within fp32 drift of the same model on PyTorch's ops; as Hugging
    # Face's, it has a padding row (token 0), and the batches' last 5 targets are -100
    if UNDER_SANITIZER:
        raise Skip("under compute-sanitizer: Inductor compiling outlasts a sweep")
    import torch._dynamo
    steps, losses = 10, {}
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 48, (8, 33), generator=g).to(DEV) for _ in range(steps)]
    targets = [b[:, 1:].clone().index_fill_(1, torch.arange(27, 32, device=DEV), -100) for b in batches]

    def train(ours):
        torch.manual_seed(0)
        model = _FunctionalGPT().to(DEV)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with inference.patched(kernels) if ours else contextlib.nullcontext():
            step_model = torch.compile(model, fullgraph=True) if ours else model
            losses[ours] = []
            for b, t in zip(batches, targets, strict=True):
                loss = step_model(b[:, :-1], t)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses[ours].append(loss.item())
        torch._dynamo.reset()
    train(False)
    launches = our_launches(lambda: train(True), ("embedding", "layer_norm", "linear", "gelu",
                                                  "scaled_dot_product_attention", "cross_entropy"))
    check("losses", torch.tensor(losses[True]), torch.tensor(losses[False]), 1e-4)
    return f"{steps} steps compiled whole on our ops ({launches} launches of our kernels); loss " \
        f"{losses[True][0]:.4f} -> {losses[True][-1]:.4f}"


for _fn in (inference_cache_matches_full_forward, inference_slides_when_full, inference_sampling_is_seeded,
            inference_moe_weights_sum_to_one, inference_cli_cpu, inference_bad_inputs,
            inference_interrupt_keeps_results, inference_option_typos, inference_patched_routes, inference_trained_row,
            inference_match_margins, inference_patched_calls, inference_sigterm_keeps_results,
            inference_second_run_beside_first, inference_patched_dropout, inference_patched_cross_entropy_bad_target):
    add(_fn.__name__.replace("_", "/", 1), _fn, gpu=False)


# inference.apply_kernels: Hugging Face models' own modules (RMSNorm, SwiGLU MLP, RoPE, Conv1D, GELU) on our ops

HF_ARCHS = ("llama", "qwen2", "mistral", "gpt2")
HF_LAYERS = 2
# A whole model on the GPU, logits and a few steps' losses against PyTorch's: on an H200 the logits differ by up
# to 8.1e-6 and the losses by 9.5e-7; 3e-5 is ~4x that, where single-pass TF32 products (~1e-3) fail. On the
# CPU our ops are _fake_kernels, PyTorch's arithmetic: PATCHED_TOL's fp32 rounding.
HF_GPU_TOL = (3e-5, 3e-5)


def _transformers():
    """transformers, imported by these cases only: CI does not install it, and they skip there, saying so."""
    try:
        import transformers
    except ImportError as e:
        raise Skip(f"transformers is not installed ({e}); pip install transformers")
    transformers.logging.set_verbosity_error()
    return transformers


def _hf_model(arch, dev="cpu", width=64, **config):
    """A tiny transformers causal LM (llama, qwen2, mistral or gpt2), random weights of seed 0, no download: 64
    wide (head size 16, which our attention runs tiled; 128: 32, fused), HF_LAYERS layers, 4 heads (2 K/V heads),
    vocabulary 100, no dropout; weights drawn at std 0.2, where HF's 0.02 leaves the MLP's inputs so near 0 that
    GELU's two approximations give the same logits to 1e-7."""
    T = _transformers()
    common = dict(vocab_size=100, initializer_range=0.2, bos_token_id=0, eos_token_id=0)
    if arch == "gpt2":
        cfg = T.GPT2Config(n_embd=width, n_layer=HF_LAYERS, n_head=4, n_positions=64, resid_pdrop=0.0,
                           embd_pdrop=0.0, attn_pdrop=0.0, **common, **config)
    else:
        cfg = {"llama": T.LlamaConfig, "qwen2": T.Qwen2Config, "mistral": T.MistralConfig}[arch](
            hidden_size=width, intermediate_size=2 * width, num_hidden_layers=HF_LAYERS, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, **common, **config)
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(cfg).to(dev)


def _hf_calls(arch):
    """Calls of the swapped modules in one forward, by the name apply_kernels counts them under."""
    if arch == "gpt2":
        return {"Conv1D": 4 * HF_LAYERS, "NewGELUActivation": HF_LAYERS}  # c_attn, attention's c_proj, c_fc, c_proj
    prefix = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}[arch]
    return {f"{prefix}RMSNorm": 2 * HF_LAYERS + 1, f"{prefix}MLP": HF_LAYERS, "apply_rotary_pos_emb": HF_LAYERS}


def _hf_forwards(model):
    """Every forward of the model's classes and every apply_rotary_pos_emb of their modules, as they are now."""
    return {(owner, attr): vars(owner).get(attr) for cls in {type(m) for m in model.modules()}
            for owner, attr in ((cls, "forward"), (sys.modules[cls.__module__], "apply_rotary_pos_emb"))}


def run_hf_model(kernels, dev, arch, tol, steps=3):
    """A tiny transformers model under inference.apply_kernels(kernels): (a) its logits within tol of the same
    model's without it, (b) `steps` AdamW steps' losses within tol of a twin's trained without it, (c) every call
    of each swapped module ours, (d) after the block every forward the original object and the logits the same
    bits as before it, (e) a model built inside the block computes as the one built before it, in it and after."""
    model, want_calls = _hf_model(arch, dev), _hf_calls(arch)
    idx = torch.randint(0, 100, (2, 16), device=dev)
    batches = torch.randint(0, 100, (steps, 4, 16), device=dev)
    with torch.no_grad():
        want, originals = model(idx).logits, _hf_forwards(model)
        with inference.apply_kernels(model, kernels, device_type=dev.type) as counts:
            got = model(idx).logits
            inside = _hf_model(arch, dev)
            got_inside = inside(idx).logits
            assert _hf_forwards(model) != originals, "nothing was swapped"
        assert dict(counts) == {(n, "ours"): 2 * c for n, c in want_calls.items()}, f"calls {dict(counts)}"
        assert _hf_forwards(model) == originals, "a forward was not put back: " + ", ".join(
            f"{getattr(o, '__name__', o)}.{a}" for (o, a), f in _hf_forwards(model).items() if f is not originals[o, a])
        assert torch.equal(model(idx).logits, want), "the logits after the block differ from those before it"
        assert torch.equal(inside(idx).logits, want), "a model built in the block computes otherwise after it"
    check("logits", got, want, tol)
    assert torch.equal(got_inside, got), "a model built in the block computes otherwise than one built before it"
    losses = {}
    for ours in (False, True):
        net = _hf_model(arch, dev)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        block = inference.apply_kernels(net, kernels, device_type=dev.type) if ours else contextlib.nullcontext()
        with block as n:
            losses[ours] = []
            for b in batches:
                loss = net(b, labels=b).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses[ours].append(loss.detach())
    assert dict(n) == {(name, "ours"): steps * k for name, k in want_calls.items()}, f"training calls {dict(n)}"
    check("losses", torch.stack(losses[True]), torch.stack(losses[False]), tol)
    return f"{sum(counts.values()) + sum(n.values())} calls of swapped modules, all ours; loss " \
        f"{losses[True][0].item():.4f} -> {losses[True][-1].item():.4f}"


def inference_hf_model(arch):
    # on the CPU, our ops as _fake_kernels (PyTorch's arithmetic, our ops' checks and dtype rules)
    return run_hf_model(_fake_kernels([]), torch.device("cpu"), arch, PATCHED_TOL[torch.float32])


def inference_gpu_hf_model(arch):
    return run_hf_model(kernels, torch.device(DEV), arch, HF_GPU_TOL)


def inference_hf_fallbacks():
    # where our ops cannot take a call in a model, a swapped module runs its original forward, counted as PyTorch's
    calls, idx = [], torch.randint(0, 100, (2, 16))
    fake = _fake_kernels(calls)

    def run(model, **kwargs):
        with torch.no_grad():
            want = model(idx, **kwargs).logits
            with inference.apply_kernels(model, fake, device_type="cpu") as counts:
                got = model(idx, **kwargs).logits
        return got, want, {f"{n} {way}": k for (n, way), k in counts.items()}

    got, want, counts = run(_hf_model("llama").double())  # float64: every call PyTorch's
    assert torch.equal(got, want) and not calls, f"float64: {len(calls)} calls of ours"
    assert counts == {"LlamaRMSNorm torch": 5, "LlamaMLP torch": 2, "apply_rotary_pos_emb torch": 2}, counts
    # positions per row (packed sequences): cos, sin (2, T, D), where ours reads one (T, D/2) table
    got, want, counts = run(_hf_model("llama"), position_ids=torch.stack([torch.arange(16), torch.arange(5, 21)]))
    check("positions per row", got, want, PATCHED_TOL[torch.float32])
    assert counts == {"LlamaRMSNorm ours": 5, "LlamaMLP ours": 2, "apply_rotary_pos_emb torch": 2}, counts
    # a GELU MLP: the original's forward, in which the GELU module is ours
    got, want, counts = run(_hf_model("llama", hidden_act="gelu"))
    check("gelu mlp", got, want, PATCHED_TOL[torch.float32])
    assert counts == {"LlamaRMSNorm ours": 5, "LlamaMLP torch": 2, "GELUActivation ours": 2,
                      "apply_rotary_pos_emb ours": 2}, counts
    # a hooked projection (as accelerate hooks them): our linear would skip the hook
    model, seen = _hf_model("llama"), []
    model.model.layers[1].mlp.up_proj.register_forward_hook(lambda *a: seen.append(1))
    got, want, counts = run(model)
    assert counts["LlamaMLP torch"] == 1 and counts["LlamaMLP ours"] == 1 and len(seen) == 2, (counts, seen)
    return "float64, positions per row, a GELU MLP, a hooked projection: the originals where ours cannot"


def inference_hf_built_inside_patched():
    # HF's GELUActivation keeps F.gelu from when it is built: inside patched(), patched()'s function, which after
    # the block is PyTorch's own (no call of ours); under apply_kernels both models run our gelu alike
    calls, idx = [], torch.randint(0, 100, (2, 16))
    fake = _fake_kernels(calls)
    before = _hf_model("gpt2", activation_function="gelu")
    with inference.patched(fake, device_type="cpu"):
        inside = _hf_model("gpt2", activation_function="gelu")
    with torch.no_grad():
        want = [m(idx).logits for m in (before, inside)]
        assert not calls, f"after patched() a model built in it called our ops: {collections.Counter(calls)}"
        with inference.apply_kernels(before, fake, device_type="cpu") as counts:
            got = [m(idx).logits for m in (before, inside)]
    assert torch.equal(want[0], want[1]) and torch.equal(got[0], got[1]), "the two models differ"
    check("logits", got[0], want[0], PATCHED_TOL[torch.float32])
    assert dict(counts) == {("GELUActivation", "ours"): 4, ("Conv1D", "ours"): 16}, dict(counts)
    return f"{sum(counts.values())} calls of swapped modules, all ours, both models alike"


def run_hf_generate(kernels, dev, arch):
    """Greedy generation (transformers' generate: a prefill, then one query a step against its KV cache) of a tiny
    model (head size 32) under patched() and apply_kernels(): the same new tokens as without them, every call ours,
    and tokens that vary (a model that repeated one token would make the match prove nothing)."""
    model = _hf_model(arch, dev, width=128)
    prompt = torch.randint(1, 100, (2, 8), generator=torch.Generator().manual_seed(1)).to(dev)
    kw = dict(max_new_tokens=24, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompt))
    with torch.no_grad():
        want = model.generate(prompt, **kw)
        with inference.patched(kernels, device_type=dev.type) as calls, \
                inference.apply_kernels(model, kernels, device_type=dev.type) as modules:
            got = model.generate(prompt, **kw)
    new = want[:, prompt.shape[1]:]
    assert len(set(new.flatten().tolist())) >= 8, f"the model repeats itself: {new.tolist()}"
    for row, (a, b) in enumerate(zip(got.tolist(), want.tolist(), strict=True)):
        assert a == b, f"row {row}: tokens differ from position {inference.first_difference(a, b)}"
    counts = calls + modules
    assert counts and all(way == "ours" for _, way in counts), f"calls on PyTorch's: {dict(counts)}"
    return f"{new.numel()} new tokens equal ({len(set(new.flatten().tolist()))} distinct); {sum(counts.values())} calls, all ours"


def inference_hf_generate(arch):
    return run_hf_generate(_fake_kernels([]), torch.device("cpu"), arch)


def inference_gpu_hf_generate(arch):
    return run_hf_generate(kernels, torch.device(DEV), arch)


for _arch in ("llama", "gpt2"):
    add(f"inference/hf_generate_{_arch}", inference_hf_generate, _arch, gpu=False)
    add(f"inference/gpu_hf_generate_{_arch}", inference_gpu_hf_generate, _arch)


def inference_hf_compiled_attention():
    # Compiling, HF builds the whole causal mask (it cannot tell compiling from exporting) where it would pass SDPA
    # is_causal; apply_kernels makes its mask function pass is_causal, so patched()'s route takes the attention,
    # which a mask sends to PyTorch's. Our ops are _fake_kernels here, called while Dynamo traces. Recent
    # transformers ask torch.compiler.is_exporting(), which torch < 2.14's Dynamo reads as True while compiling: made
    # so here on any torch (older transformers refuse the skip whenever Dynamo traces).
    idx, seen = torch.randint(0, 100, (2, 16)), {}
    masking = _transformers().masking_utils
    exporting = (unittest.mock.patch.object(masking, "is_torchdynamo_exporting", torch.compiler.is_compiling)
                 if hasattr(masking, "is_torchdynamo_exporting") else contextlib.nullcontext())
    for arch in ("llama", "mistral", "gpt2"):  # Mistral's sliding window, longer than the sequence
        calls, model = [], _hf_model(arch)
        fake = _fake_kernels(calls)
        with torch.no_grad():
            want = model(idx).logits
            with inference.patched(fake, device_type="cpu"), inference.apply_kernels(model, fake, device_type="cpu"), \
                    exporting:
                got = torch.compile(model, backend="eager")(idx).logits
        torch._dynamo.reset()
        seen[arch] = calls.count("attention")
        assert seen[arch] == HF_LAYERS, f"{arch}: {seen[arch]} attention calls of ours, expected {HF_LAYERS}"
        check(f"{arch} logits", got, want, PATCHED_TOL[torch.float32])
    return f"compiled, attention calls of ours: {seen}"


add("inference/hf_compiled_attention", inference_hf_compiled_attention, gpu=False)


@mutant("apply_kernels_keeps_hf_compiled_mask", "inference/hf_compiled_attention")
def _apply_kernels_keeps_hf_compiled_mask():
    with unittest.mock.patch.object(inference, "_causal_sdpa_mask", lambda original, masking: original):
        yield


def _hf_swapped_calls(dev):
    """The swapped forwards one call at a time, as _patched_calls's rows (label, route, autocast dtype, device or
    None, call), and the modules to give apply_kernels for them: Llama's RMSNorm (its weight drawn, not HF's ones),
    MLP and apply_rotary_pos_emb, GPT-2's Conv1D and every GELU module of HF_GELUS, ours where our ops take the
    inputs (fp32, bf16, bf16 autocast) and the originals elsewhere. A GELU module given the other approximation
    is off by up to 4.7e-4 (at |x| = 2.7), 20x fp32's tolerance there."""
    T, bf16 = _transformers(), torch.bfloat16
    llama, gpt2, llama_b, gpt2_b = (_hf_model(a, dev) for a in ("llama", "gpt2", "llama", "gpt2"))
    with torch.no_grad():
        for m in (llama, llama_b):
            m.model.norm.weight.copy_(torch.linspace(-2, 2, 64))
    llama_b, gpt2_b = llama_b.to(bf16), gpt2_b.to(bf16)
    norm, mlp, conv = llama.model.norm, llama.model.layers[0].mlp, gpt2.transformer.h[0].mlp.c_fc
    norm_b, mlp_b, conv_b = llama_b.model.norm, llama_b.model.layers[0].mlp, gpt2_b.transformer.h[0].mlp.c_fc
    norm_d = copy.deepcopy(norm).double()
    gelus = [getattr(T.activations, n)() for n in inference.HF_GELUS if hasattr(T.activations, n)] + \
        [T.activations.GELUActivation(use_gelu_python=True), T.activations.GELUTanh(use_gelu_tanh_python=True)]
    mod = sys.modules[type(llama.model.layers[0].self_attn).__module__]
    x = torch.randn(2, 5, 64, device=dev)
    # the MLP is three ops: at unit inputs its bf16 outputs (std 5) carry PyTorch's extra rounding of silu(a) * b
    # past one op's tolerance; at a quarter they stay near 1. GELU's approximations part most near |x| = 2.7.
    xb, xm, xg = x.to(bf16), x / 4, 3 * x
    xmb = xm.to(bf16)
    q, k = torch.randn(2, 4, 5, 16, device=dev), torch.randn(2, 2, 5, 16, device=dev)
    pos, rows = torch.arange(5, device=dev)[None], torch.stack([torch.arange(5), torch.arange(3, 8)]).to(dev)
    cos, sin = llama.model.rotary_emb(x, pos)  # (1, 5, 16): one set of positions, the angles twice
    cos_b, sin_b = (t.to(bf16) for t in (cos, sin))
    cos_r, sin_r = llama.model.rotary_emb(x, rows)  # (2, 5, 16): positions per row
    cos_e, sin_e = llama.model.rotary_emb(x, pos.expand(2, -1))  # (2, 5, 16), rows alike: generate's position ids

    def rope(q, k, cos, sin, **kw):  # both rotated heads in one tensor: the table compares one output
        return lambda: torch.cat([t.flatten() for t in mod.apply_rotary_pos_emb(q, k, cos, sin, **kw)])
    calls = [
        ("rmsnorm fp32", "ours", None, None, lambda: norm(x)),
        ("rmsnorm bf16", "ours", None, None, lambda: norm_b(xb)),
        ("rmsnorm fp32, autocast", "ours", bf16, None, lambda: norm(x)),
        ("rmsnorm bf16 input, fp32 weight (HF's promotes)", "torch", None, None, lambda: norm(xb)),
        ("rmsnorm float64", "torch", None, None, lambda: norm_d(x.double())),
        ("mlp fp32", "ours", None, None, lambda: mlp(xm)),
        ("mlp bf16", "ours", None, None, lambda: mlp_b(xmb)),
        ("mlp fp32, autocast", "ours", bf16, None, lambda: mlp(xm)),
        ("mlp bf16 input, fp32 weights", "torch", None, None, lambda: mlp(xmb)),
        ("conv1d fp32", "ours", None, None, lambda: conv(x)),
        ("conv1d bf16", "ours", None, None, lambda: conv_b(xb)),
        ("conv1d fp32, autocast", "ours", bf16, None, lambda: conv(x)),
        ("conv1d bf16 input, fp32 weight", "torch", None, None, lambda: conv(xb)),
        ("rope fp32", "ours", None, None, rope(q, k, cos, sin)),
        ("rope bf16", "ours", None, None, rope(q.to(bf16), k.to(bf16), cos_b, sin_b)),
        ("rope bf16 heads, fp32 tables (autocast's)", "ours", None, None, rope(q.to(bf16), k.to(bf16), cos, sin)),
        ("rope positions per row", "torch", None, None, rope(q, k, cos_r, sin_r)),
        ("rope positions per row, all alike", "ours", None, None, rope(q, k, cos_e, sin_e)),
        ("rope unequal halves", "torch", None, None, rope(q, k, torch.rand_like(cos), sin)),
        ("rope (B, T, H, D) heads", "torch", None, None, rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin,
                                                               unsqueeze_dim=2)),
        ("rope float64", "torch", None, None, rope(q.double(), k.double(), cos.double(), sin.double())),
        ("gelu_new bf16", "ours", None, None, lambda: gelus[0](xb)),
        ("gelu float64", "torch", None, None, lambda: gelus[0](xg.double()))]
    calls += [(f"{type(g).__name__}{' (Python)' * (i >= len(gelus) - 2)} fp32", "ours", None, None,
               functools.partial(g, xg)) for i, g in enumerate(gelus)]
    return torch.nn.ModuleList([llama, gpt2, llama_b, gpt2_b, *gelus]), calls


def run_hf_calls(kernels, dev):
    modules, calls = _hf_swapped_calls(dev)
    with torch.no_grad():
        return run_patched_calls(kernels, dev, calls, functools.partial(inference.apply_kernels, modules))


def inference_hf_calls():
    # every call of _hf_swapped_calls on the CPU, our ops as _fake_kernels
    return run_hf_calls(_fake_kernels([]), torch.device("cpu"))


def inference_gpu_hf_calls():
    if torch.cuda.get_device_capability() != (9, 0):
        raise Skip("the table's bf16 products are ours on Hopper's wgmma alone (compute capability 9.0)")
    return run_hf_calls(kernels, torch.device(DEV))


for _arch in HF_ARCHS:
    add(f"inference/hf_{_arch}", inference_hf_model, _arch, gpu=False)
    add(f"inference/gpu_hf_{_arch}", inference_gpu_hf_model, _arch)
add("inference/hf_fallbacks", inference_hf_fallbacks, gpu=False)
add("inference/hf_calls", inference_hf_calls, gpu=False)
add("inference/gpu_hf_calls", inference_gpu_hf_calls)
add("inference/hf_built_inside_patched", inference_hf_built_inside_patched, gpu=False)


def _hf_cases(*names):
    return [f"inference/{gpu}hf_{name}" for name in names for gpu in ("", "gpu_")]


def _hf_table_emptied(table):
    """A mutant's plant: apply_kernels leaves out one kind of module (its table emptied)."""
    with unittest.mock.patch.object(inference, table, type(getattr(inference, table))()):
        yield


for _table in ("HF_RMSNORMS", "HF_SWIGLU_MLPS", "HF_ROPE_ATTENTIONS", "HF_CONV1DS", "HF_GELUS"):
    _archs = ("gpt2",) if _table in ("HF_CONV1DS", "HF_GELUS") else ("llama", "qwen2", "mistral")
    mutant(f"apply_kernels_skips_{_table[3:].lower()}", *_hf_cases(*_archs, "calls"))(
        functools.partial(_hf_table_emptied, _table))


@mutant("apply_kernels_gelu_other_approximation", "inference/hf_built_inside_patched", *_hf_cases("gpt2", "calls"))
def _apply_kernels_gelu_other_approximation():
    other = {name: {"none": "tanh", "tanh": "none"}[a] for name, a in inference.HF_GELUS.items()}
    with unittest.mock.patch.object(inference, "HF_GELUS", other):
        yield


@mutant("apply_kernels_undo_leaves_a_swap", *_hf_cases(*HF_ARCHS))
def _apply_kernels_undo_leaves_a_swap():
    # the block's end puts back every forward but the MLP's or the Conv1D's (then put back here, for later cases)
    real, left = inference.apply_kernels, {}

    @contextlib.contextmanager
    def leaky(model, *args, **kwargs):
        cls = next(type(m) for m in model.modules() if type(m).__name__ in inference.HF_SWIGLU_MLPS + ("Conv1D",))
        left.setdefault(cls, vars(cls)["forward"])
        with real(model, *args, **kwargs) as counts:
            stand_in = cls.forward
            yield counts
        cls.forward = stand_in
    try:
        with unittest.mock.patch.object(inference, "apply_kernels", leaky):
            yield
    finally:
        for cls, original in left.items():
            cls.forward = original


@mutant("apply_kernels_takes_any_dtype", "inference/hf_fallbacks", "inference/hf_calls", "inference/patched_calls")
def _apply_kernels_takes_any_dtype():
    # our ops' dtype and device rule, which patched()'s routes share, lets every tensor through
    with unittest.mock.patch.object(inference, "_takes", lambda device_type, *tensors: True):
        yield


@mutant("apply_kernels_rope_halves_unchecked", *_hf_cases("calls"))
def _apply_kernels_rope_halves_unchecked():
    # our rope takes tables whose halves differ, as if HF's rotary embedding had made them
    with unittest.mock.patch.object(torch, "equal", lambda a, b: True):
        yield


# --bench --only hf: a Hugging Face model's training step (forward, backward, AdamW) on PyTorch's ops against the
# same model under patched() and apply_kernels(), in one run; hf_compiled: both under torch.compile too.
HF_BENCH_BATCH, HF_BENCH_SEQ = 8, 512


def _hf_bench_model(arch, dev):
    """A mid-sized transformers causal LM (1024 wide, 8 layers, 16 heads; Llama-style ones 4 K/V heads and MLP
    2816 wide), random weights of seed 0, vocabulary 32000, no dropout."""
    T = _transformers()
    common = dict(vocab_size=32000, bos_token_id=0, eos_token_id=0)
    if arch == "gpt2":
        cfg = T.GPT2Config(n_embd=1024, n_layer=8, n_head=16, n_positions=HF_BENCH_SEQ, resid_pdrop=0.0,
                           embd_pdrop=0.0, attn_pdrop=0.0, **common)
    else:
        cfg = {"llama": T.LlamaConfig, "qwen2": T.Qwen2Config, "mistral": T.MistralConfig}[arch](
            hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
            num_key_value_heads=4, max_position_embeddings=HF_BENCH_SEQ, **common)
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(cfg).to(dev)


def hf_step_ms(arch, dtype, ours, compiled, steps=20):
    """Median ms of a training step, the last step's loss, and the eager calls by (name, "ours"/"torch")."""
    model = _hf_bench_model(arch, DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (HF_BENCH_BATCH, HF_BENCH_SEQ), device=DEV)
    counted = [collections.Counter()]  # patched()'s and apply_kernels()'s, which count every eager call
    with contextlib.ExitStack() as stack:
        if ours:
            counted = [stack.enter_context(inference.patched(kernels)),
                       stack.enter_context(inference.apply_kernels(model, kernels))]
        net = torch.compile(model) if compiled else model
        autocast = torch.autocast("cuda", torch.bfloat16, enabled=dtype == BF16)

        def step():
            with autocast:
                loss = net(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
        for _ in range(3):  # warm-up: compilation, optimizer state, library handles
            step()
        for c in counted:
            c.clear()
        step()
        calls = sum(counted, collections.Counter())  # one step's
        times = []
        for _ in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    torch._dynamo.reset()
    return statistics.median(times), loss.item(), calls


@bench_rows("hf")
def bench_hf(rows, compiled_too=False):
    try:
        _transformers()
    except Skip as e:
        print(f"\nhf: {e}")
        return
    title = f"{HF_BENCH_BATCH}x{HF_BENCH_SEQ} tokens, 1024 wide, 8 layers"
    print(f"\nHugging Face training step (forward, backward, AdamW), {title}; ours = patched() + apply_kernels()")
    cols = ["arch", "dtype", "mode", "torch ms", "ours ms", "torch/ours", "loss torch", "loss ours",
            "calls ours/torch"]
    print(md_row(cols))
    print(md_row(["---"] * len(cols)))
    modes = (False, True) if compiled_too else (False,)
    for arch in HF_ARCHS:
        for dtype in (torch.float32, BF16):
            for compiled in modes:
                (t_ms, t_loss, _), (o_ms, o_loss, calls) = (hf_step_ms(arch, dtype, ours, compiled)
                                                            for ours in (False, True))
                n_ours = sum(k for (_, way), k in calls.items() if way == "ours")
                n_torch = sum(calls.values()) - n_ours
                name, mode = "bf16 autocast" if dtype == BF16 else "fp32", "compiled" if compiled else "eager"
                rows.append(dict(op="hf step", shape=f"{arch} {name} {mode}", torch_ms=t_ms, ours_ms=o_ms,
                                 torch_over_ours=t_ms / o_ms, calls_ours=n_ours, calls_torch=n_torch,
                                 torch_calls={n: k for (n, way), k in calls.items() if way == "torch"}))
                print(md_row([arch, name, mode, f"{t_ms:.2f}", f"{o_ms:.2f}", f"{t_ms / o_ms:.2f}x",
                              f"{t_loss:.4f}", f"{o_loss:.4f}",
                              "- (traced)" if compiled else f"{n_ours}/{n_torch}" + "".join(
                                  f" {n}:{k}" for (n, way), k in sorted(calls.items()) if way == "torch")]),
                      flush=True)


@bench_rows("hf_compiled")
def bench_hf_compiled(rows):
    bench_hf(rows, compiled_too=True)


class _KeptRoutes(dict):
    def clear(self):  # patched()'s end leaves its routes in place
        pass


@mutant("patched_routes_after_its_block", "inference/hf_built_inside_patched")
def _patched_routes_after_its_block():
    real = inference._functional_routes
    with unittest.mock.patch.object(inference, "_functional_routes", lambda *args: _KeptRoutes(real(*args))):
        yield


def inference_gpu_paths_agree():
    # both op sets, eager and graphed, decode the same tokens with nearly the same margins: greedy for
    # the dense and the MoE model, and sampling (temperature, top-k, the same uniforms) for the dense one;
    # ours also with ordinary launches (kernels.set_pdl(False)), which must not change a bit
    kernels_ops = train.cuda_op_set(kernels, 32)
    n_new = under_tool(20, 4)
    uniforms = torch.rand(n_new)
    for arch, n_expert, temperature, k in (("gpt", 0, 0.0, 0), ("gpt", 4, 0.0, 0), ("gpt", 0, 0.8, 5),
                                           ("llama", 0, 0.0, 0), ("llama", 4, 0.0, 0), ("llama", 0, 0.8, 5)):
        model = _decoder_gpt(n_expert, DEV, n_embd=64, arch=arch)  # head size 32: the fused attention's
        toks, margins, logits = {}, {}, {}
        for name, ops, pdl in (("torch", train.TORCH_OPS, True), ("cuda", kernels_ops, True),
                               ("cuda_ordinary_launch", kernels_ops, False)):
            for graphed in (False, True):
                model.ops = ops
                dec = inference.Decoder(model, n_new, temperature, k, uniforms, _decode_mode(graphed))
                kernels.set_pdl(pdl)
                try:
                    with torch.no_grad():
                        inference.generate(dec, torch.tensor([3, 1, 4], device=DEV), n_new)
                finally:
                    kernels.set_pdl(True)
                toks[name, graphed], margins[name, graphed], logits[name, graphed] = \
                    dec.tokens.tolist(), dec.margins, dec.logits
        for graphed in (False, True):
            assert torch.equal(logits["cuda_ordinary_launch", graphed], logits["cuda", graphed]), \
                f"{arch}, n_expert={n_expert}: ordinary launches changed the logits"
        ref = toks["torch", False]
        assert all(t == ref for t in toks.values()), f"{arch}, n_expert={n_expert}, temperature {temperature}: {toks}"
        if temperature == 0:
            assert inference.longest_run(ref) <= 4 and len(set(ref)) >= n_new // 3, f"degenerate text: {ref}"
        for key in margins:
            label = f"{arch}_{n_expert}_t{temperature}_{key[0]}_{'graph' if key[1] else 'eager'}"
            check(f"logits_{label}", logits[key], logits["torch", False], 1e-5)
            check(f"margins_{label}", margins[key], margins["torch", False], 1e-5)


add("inference/gpu_paths_agree", inference_gpu_paths_agree)


BF16_LOGIT_BOUND = 0.1  # bf16 decodes of one model on two paths, logits before they part: up to 4.5e-2 measured (H200)


def _parted_at_a_near_tie(label, ref, dec, bound=BF16_LOGIT_BOUND):
    """Two decodes of one model (inference.Decoder after generate): at every step before and at the first new
    token where they part (the context still the same) their logits are within bound, and that token was a
    near tie (inference.NEAR_TIE). Returns a note."""
    toks_ref, toks = ref.tokens.tolist(), dec.tokens.tolist()
    i = inference.first_difference(toks_ref, toks)
    n = len(toks) if i is None else i + 1
    diff = (ref.logits[:n] - dec.logits[:n]).abs().amax(-1)
    worst = diff.max().item()
    assert worst <= bound, f"{label}: logits differ by {worst:.2e} at new token {int(diff.argmax())}, over {bound}"
    if i is None:
        return f"{label}: {n}/{n} equal, logits within {worst:.1e}"
    m = ref.margins[i].item()
    assert m <= inference.NEAR_TIE * worst, (f"{label}: part at new token {i} with margin {m:.2e}, over "
                                             f"{inference.NEAR_TIE}x the logits' difference {worst:.2e}")
    return f"{label}: equal to new token {i}, a near tie (margin {m:.1e}; logits within {worst:.1e})"


def inference_gpu_bf16_paths():
    # bf16 weights, activations and KV cache (inference.with_dtype) on both op sets, greedy: each op set
    # decodes the same tokens eager and graphed (its kernels are deterministic); across op sets bf16's
    # rounding may flip a near tie: their logits stay within BF16_LOGIT_BOUND until they part
    if torch.cuda.get_device_capability() != (9, 0):
        raise Skip("bf16 prefill runs our bf16 matmul, on Hopper's wgmma (compute capability 9.0)")
    notes, n_new = [], under_tool(20, 4)
    for arch, n_expert in (("gpt", 0), ("gpt", 4), ("llama", 0)):
        model = inference.with_dtype(_decoder_gpt(n_expert, DEV, n_embd=64, arch=arch), "bf16")
        decs = {}
        for name, ops in (("torch", train.TORCH_OPS), ("cuda", train.cuda_op_set(kernels, 32))):
            for graphed in (False, True):
                model.ops = ops
                decs[name, graphed] = _decode(model, [3, 1, 4], n_new)
        for name in ("torch", "cuda"):
            assert torch.equal(decs[name, False].logits, decs[name, True].logits), \
                f"{arch} {n_expert}: {name} graphed differs from {name} eager"
        notes.append(_parted_at_a_near_tie(f"{arch} E={n_expert}", decs["torch", False], decs["cuda", False]))
    return "; ".join(notes)


add("inference/gpu_bf16_paths", inference_gpu_bf16_paths)


# decode_megakernel's shapes: (arch, n_embd, n_head, n_kv_head, context, (experts, top_k) or None for dense);
# head sizes 96, 64 and 32 (grouped-query) and 40 (no multiple of a warp), widths that are no multiple of a
# tile, one narrower than the SMs are many (blocks with no rows of a product); llama at inference.py's shape
# and at head size 40 (SwiGLU 576 wide); mixtures of experts taking 2 of 4 (gpt, llama) and 1 of 3.
_MK_SHAPES = (("gpt", 768, 8, 8, 64, None), ("gpt", 256, 4, 2, 48, None), ("gpt", 200, 5, 5, 40, None),
              ("gpt", 64, 2, 1, 32, None), ("llama", 768, 8, 4, 64, None), ("llama", 200, 5, 5, 40, None),
              ("gpt", 256, 4, 2, 48, (4, 2)), ("llama", 200, 5, 5, 40, (4, 2)), ("gpt", 64, 2, 1, 32, (3, 1)))


def _mk_model(arch, n_embd, n_head, n_kv, block, moe=None, n_layer=3, dtype="fp32"):
    mlp = (lambda: inference.MoE(n_embd, *moe, arch)) if moe else None
    model = train.GPT(95, block, n_embd, n_head, n_layer, 0, train.TORCH_OPS, n_kv_head=n_kv, arch=arch,
                      mlp=mlp, init_std=inference.context_std(n_embd)).to(DEV).eval()
    # biases and norms off their zero / one init, each its own draw, so that one used in another's place shows
    for i, (name, p) in enumerate(model.named_parameters()):
        if p.dim() == 1 or name.endswith("_b"):
            with torch.no_grad():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)).to(DEV))
    model = inference.with_dtype(model, dtype)
    if why := inference.megakernel_why_not(model):
        raise Skip(f"decode_megakernel: {why}")
    return model


def _mk_prefilled(model, prompt):
    """A cache holding the prompt (torch op set), and a copy of it."""
    cache = inference.kv_cache(model, DEV)
    model.ops = train.TORCH_OPS
    with torch.no_grad():
        model(torch.tensor([prompt], device=DEV), cache=cache)
    twin = inference.kv_cache(model, DEV)
    for a, b in ((twin.k, cache.k), (twin.v, cache.v), (twin.pos, cache.pos)):
        a.copy_(b)
    return cache, twin


def inference_gpu_megakernel_step():
    # one step of decode_megakernel against the model's step on the torch op set, from the same cache:
    # the logits, the key and value written at the position, the position advanced; fp32 and bf16
    notes = []
    for dtype in ("fp32", "bf16"):
        for arch, n_embd, n_head, n_kv, block, moe in _MK_SHAPES:
            model = _mk_model(arch, n_embd, n_head, n_kv, block, moe, dtype=dtype)
            cache, twin = _mk_prefilled(model, [3, 1, 4, 1, 5])
            tok = torch.tensor([[9]], device=DEV)
            with torch.no_grad():
                ref = model(tok, cache=twin)[0][0, 0]
                ours = inference.Megakernel(model, cache)(tok)
            label = f"{dtype}_{arch}_{n_embd}_{n_head}h_{n_kv}kv" + (f"_moe{moe[0]}x{moe[1]}" if moe else "")
            # bf16 rounds each op set its own way and the context-dependent model carries the difference
            # from layer to layer: logits within the bf16 decode bound, the cache within 5% of its largest entry
            tol = {n: (2e-5, 1e-4) for n in ("logits", "k", "v")} if dtype == "fp32" else \
                dict(logits=BF16_LOGIT_BOUND, k=0.05 * twin.k.float().abs().max().item(),
                     v=0.05 * twin.v.float().abs().max().item())
            check(f"logits_{label}", ours.float(), ref.float(), tol["logits"])
            check(f"k_{label}", cache.k.float(), twin.k.float(), tol["k"])  # position 5 written, no other
            check(f"v_{label}", cache.v.float(), twin.v.float(), tol["v"])
            assert cache.pos.item() == twin.pos.item() == 6, f"{label}: pos {cache.pos.item()}, twin {twin.pos.item()}"
        notes.append(f"{dtype}: {len(_MK_SHAPES)} shapes")
    return "; ".join(notes)


def inference_gpu_megakernel_tokens():
    # greedy fp32 decoding on the megakernel (graphed with the pick) picks the graphed op sets' tokens over
    # 200 steps through several context slides, with their logits and margins; bf16 against the cuda op
    # set's graph (the torch op set's where the fused attention lacks the head size): logits within
    # BF16_LOGIT_BOUND until they part at a near tie, as between op sets (a mixture's router may meet a
    # near tie of its own and flip an expert: reported)
    n_new, notes = under_tool(200, 4), []
    for dtype in ("fp32", "bf16"):
        for arch, n_embd, n_head, n_kv, block, moe in _MK_SHAPES:
            model = _mk_model(arch, n_embd, n_head, n_kv, block, moe, dtype=dtype)
            hs, decs = n_embd // n_head, {}
            # the cuda op set decodes with the fused attention: where it lacks the head size, the
            # megakernel's prefill and pick run on the torch op set
            cuda = train.cuda_op_set(kernels, hs) if hs in kernels.LIMITS["fused_head_sizes"] else None
            paths = [("torch", train.TORCH_OPS, "graph"), ("cuda", cuda, "graph"),
                     ("megakernel", cuda or train.TORCH_OPS, "megakernel")]
            for name, ops, mode in paths:
                if ops is None or (dtype == "bf16" and name == "torch" and cuda is not None):
                    continue
                model.ops = ops
                dec = inference.Decoder(model, n_new, 0.0, 0, torch.rand(n_new), mode)
                with torch.no_grad():
                    inference.generate(dec, torch.tensor([3, 1, 4], device=DEV), n_new)
                decs[name] = dec
            label = f"{dtype} {arch} {n_embd}/{n_head}h/{n_kv}kv" + (f" moe {moe[1]} of {moe[0]}" if moe else "")
            if dtype == "fp32":
                toks = {name: dec.tokens.tolist() for name, dec in decs.items()}
                assert all(t == toks["torch"] for t in toks.values()), f"{label}: {toks}"
                assert inference.longest_run(toks["torch"]) <= 8 and len(set(toks["torch"])) >= 30, \
                    f"{label}: degenerate text {toks['torch']}"
                check(f"logits_{label}", decs["megakernel"].logits, decs["torch"].logits, (2e-5, 1e-4))
                check(f"margins_{label}", decs["megakernel"].margins, decs["torch"].margins, 1e-4)
                notes.append(f"{label}: {n_new}/{n_new} equal ({len(toks)} paths)")
                continue
            ref = "cuda" if "cuda" in decs else "torch"
            if moe:
                i = inference.first_difference(decs[ref].tokens.tolist(), decs["megakernel"].tokens.tolist())
                notes.append(f"{label}: equal to {ref}'s to token {n_new if i is None else i}")
            else:
                notes.append(_parted_at_a_near_tie(f"{label} vs {ref}", decs[ref], decs["megakernel"]))
    return "; ".join(notes)


def inference_gpu_megakernel_bad_inputs():
    # a token or position out of range gives NaN logits and the op's error at the next check, nothing
    # written out of bounds; a model the kernel cannot run, or wrong arguments, a clear error
    model = _mk_model("gpt", 256, 4, 2, 48)
    cache, _ = _mk_prefilled(model, [3, 1, 4])
    mk = inference.Megakernel(model, cache)
    for tok, pos, want in ((95, 3, "decode_megakernel: tok out of range in an earlier call: got 95"),
                           (2, 48, "decode_megakernel: pos out of range in an earlier call: got 48")):
        cache.pos.fill_(pos)
        k, v = cache.k.clone(), cache.v.clone()
        with torch.no_grad():
            logits = mk(torch.tensor([[tok]], device=DEV))
        assert logits.isnan().all(), f"tok {tok}, pos {pos}: logits not NaN"
        assert cache.pos.item() == pos, f"tok {tok}, pos {pos}: the position moved to {cache.pos.item()}"
        assert torch.equal(cache.k, k) and torch.equal(cache.v, v), f"tok {tok}, pos {pos}: the cache was written"
        expect_error(ValueError, kernels.check_errors, want)
    cache.pos.fill_(3)
    args = lambda **kw: {**dict(weights=mk.weights, tok=torch.tensor([[1]], device=DEV), pos=cache.pos, k_cache=cache.k,
                                v_cache=cache.v, logits=mk.logits, workspace=mk.workspace, n_head=4), **kw}
    with torch.no_grad():
        for kw, want in ((dict(weights=mk.weights[:-1]), "weights must be wte, wpe, ln_f_w, ln_f_b, then 12 a layer"),
                         (dict(workspace=mk.workspace[:10]), "workspace must hold"),
                         (dict(workspace=mk.workspace.double()), "workspace must be float32"),
                         (dict(logits=mk.logits[:-1]), "logits must be a contiguous"),
                         (dict(n_head=3), "n_head must divide n_embd"),
                         (dict(tok=torch.tensor([[1]])), "tok must be a CUDA tensor"),
                         (dict(trace=torch.zeros(3, 5, dtype=torch.long, device=DEV)), "trace must have shape"),
                         (dict(top_k=3), f"top_k must be 0 (a dense model) or the 1 to "
                                         f"{kernels.LIMITS['megakernel_max_top_k']} experts"),
                         (dict(top_k=2), "then 13 a layer"),
                         (dict(weights=[w.t() if w.dim() == 2 and w.shape[0] == w.shape[1] else w
                                        for w in mk.weights]), "must be contiguous")):
            expect_error(RuntimeError, lambda: torch.ops.kernels.decode_megakernel(**args(**kw)), want)
    llama = _mk_model("llama", 256, 4, 2, 48)
    lcache, _ = _mk_prefilled(llama, [3, 1, 4])
    lmk = inference.Megakernel(llama, lcache)
    largs = lambda **kw: args(**{**dict(weights=lmk.weights, k_cache=lcache.k, v_cache=lcache.v, pos=lcache.pos,
                                        logits=lmk.logits, workspace=lmk.workspace, rope_cos=llama.rope_cos,
                                        rope_sin=llama.rope_sin), **kw})
    with torch.no_grad():
        for kw, want in ((dict(rope_sin=None), "rope_cos and rope_sin come together"),
                         (dict(rope_cos=llama.rope_cos[:40], rope_sin=llama.rope_sin[:40]),
                          "rope_cos must be a contiguous"),
                         (dict(rope_sin=llama.rope_sin.double()), "rope_sin must be float32"),
                         (dict(weights=mk.weights), "weights must be wte, ln_f_w, then 7 a layer")):
            expect_error(RuntimeError, lambda: torch.ops.kernels.decode_megakernel(**largs(**kw)), want)
    over = f"a head size (n_embd / n_head) over {kernels.LIMITS['megakernel_max_head_size']}"
    for n_embd, n_head, want in ((1024, 4, over), (36, 4, "an odd head size")):  # head sizes 256 and 9
        bad = train.GPT(95, 16, n_embd, n_head, 1, 0, train.TORCH_OPS).to(DEV).eval()
        expect_error(ValueError, lambda: inference.Megakernel(bad, inference.kv_cache(bad, DEV)),
                     f"decode_megakernel cannot decode this model: {want}")
    return ("NaN logits and the op's error for a bad token and position; 10 bad arguments (gpt) and 4 (llama) named; "
            "head sizes 256, 9 refused")


def inference_gpu_megakernel_trace():
    # the traced step's logits are the untraced step's, bit for bit, and its clocks show the hand-offs
    # holding: each block's stamps only grow, and in steps C, D and E, whose outputs every block writes and
    # every block reads, no block has the next step's inputs before the last block had this step's
    model = _mk_model("gpt", 256, 4, 2, 48, n_layer=4)
    cache, twin = _mk_prefilled(model, [3, 1, 4])
    tok, trace = torch.tensor([[9]], device=DEV), torch.zeros(kernels.decode_megakernel_trace_shape(4),
                                                              dtype=torch.long, device=DEV)
    with torch.no_grad():
        plain = inference.Megakernel(model, twin)(tok).clone()
        traced = inference.Megakernel(model, cache)(tok, trace)
    assert torch.equal(plain, traced), "tracing changed the logits"
    t = trace.cpu()
    assert (t[:, 1:] >= t[:, :-1]).all(), "a block's clock went back"
    if t.shape[0] > 256:
        raise Skip(f"{t.shape[0]} blocks: some have no rows of the 256-wide products to hand off")
    _, ready = megakernel_done_ready(t)
    for s in (2, 3, 4):  # C, D, E of each layer
        early = ready[:, s::5].min(0).values < ready[:, s - 1::5].max(0).values
        assert not early.any(), (f"step {MK_STEPS[s]}: a block had every block's outputs before the last block "
                                 f"had its inputs")
    steps, head, total = megakernel_timeline(t)
    return f"{t.shape[0]} blocks x {ready.shape[1]} hand-offs hold; traced step {total:.1f} us"


def inference_gpu_megakernel_sampling():
    # seeded sampling (temperature 0.8, top-5) on the megakernel draws the torch op set's graphed tokens
    # from the same uniforms: all 200 in fp32; bf16's first difference, if any, is reported
    n_new, notes = under_tool(200, 4), []
    for dtype in ("fp32", "bf16"):
        for arch, n_embd, n_head, n_kv, block, moe in _MK_SHAPES[:2] + _MK_SHAPES[4:5] + _MK_SHAPES[6:7]:
            model = _mk_model(arch, n_embd, n_head, n_kv, block, moe, dtype=dtype)
            uniforms, toks = torch.rand(n_new, generator=torch.Generator().manual_seed(5)), {}
            for mode in ("graph", "megakernel"):
                model.ops = train.TORCH_OPS
                dec = inference.Decoder(model, n_new, 0.8, 5, uniforms, mode)
                with torch.no_grad():
                    inference.generate(dec, torch.tensor([3, 1, 4], device=DEV), n_new)
                toks[mode] = dec.tokens.tolist()
            i = inference.first_difference(toks["graph"], toks["megakernel"])
            label = f"{dtype} {arch} {n_embd}/{n_head}h/{n_kv}kv" + (" moe" if moe else "")
            assert dtype != "fp32" or i is None, f"{label}: sampled tokens differ at {i}: {toks}"
            notes.append(f"{label}: equal to token {n_new if i is None else i}")
    return "; ".join(notes)


for _fn in (inference_gpu_megakernel_step, inference_gpu_megakernel_tokens, inference_gpu_megakernel_bad_inputs,
            inference_gpu_megakernel_trace, inference_gpu_megakernel_sampling):
    add(_fn.__name__.replace("_", "/", 1), _fn)


def expect_megakernel_refuses(cases, device="cpu"):
    """Each (train.GPT keywords, words): megakernel_why_not gives the reason, and Megakernel refuses the model."""
    for kw, want in cases:
        kw = {"n_embd": 32, **kw}
        model = train.GPT(95, 24, kw.pop("n_embd"), 2, 2, 0, train.TORCH_OPS, **kw).to(device)
        assert want in (inference.megakernel_why_not(model) or ""), f"{kw}: {inference.megakernel_why_not(model)}"
        try:
            inference.Megakernel(model, None)
            raise AssertionError(f"{kw}: Megakernel took the model")
        except ValueError as e:
            assert want in str(e), f"{kw}: {e}"


def inference_megakernel_refuses():
    # hyper-connection models, which decode_megakernel does not decode, say why before any GPU is asked (CPU, in CI)
    expect_megakernel_refuses([(dict(residual="mhc"), "baseline residual stream"),
                               (dict(residual="hc", n_streams=1), "baseline residual stream")])  # one stream still mixes
    return "mHC and one-stream HC models refused with their reason"


def inference_gpu_megakernel_refuses_shapes():
    # the shapes past kernels.LIMITS' megakernel entries (kernels.cu's part 0) are refused with kernels.cu's reason
    limits = kernels.LIMITS
    experts, top_k = limits["megakernel_max_experts"], limits["megakernel_max_top_k"]
    expect_megakernel_refuses([
        (dict(mlp=lambda: inference.MoE(32, top_k + 2, top_k + 1)), f"of which a token takes at most {top_k}"),
        (dict(mlp=lambda: inference.MoE(32, experts + 1, top_k)), f"mixtures of at most {experts} experts"),
        (dict(arch="llama", n_embd=8), "mlp width 64 is outside [n_embd, 4 n_embd] = [8, 32]")], DEV)
    return f"MoE of top-{top_k + 1} and of {experts + 1} experts, an mlp wider than 4 n_embd refused with their reason"


add("inference/megakernel_refuses", inference_megakernel_refuses, gpu=False)


def inference_sample_top_k_limit():
    # sampling on the cuda op set is refused past its top-k's limit (kernels.LIMITS, here a stand-in's 5),
    # naming the option or the vocabulary; the torch op set alone, or greedy decoding, has no such limit
    spec = types.SimpleNamespace(label="dense", tok=types.SimpleNamespace(vocab_size=95))
    both = {"dense": [("torch", None, "eager"), ("cuda", None, "eager")]}
    torch_only = {"dense": [("torch", None, "eager")]}
    stand_in = types.SimpleNamespace(LIMITS={"topk_max_k": 5})
    refused = []
    with unittest.mock.patch.object(data, "import_kernels", lambda: (stand_in, None)):
        for temperature, k, paths, want in ((0.8, 6, both, "--sample_top_k=6"), (0.8, 0, both, "all 95 tokens"),
                                            (0.8, 5, both, None), (0.0, 6, both, None), (0.8, 6, torch_only, None)):
            cfg = types.SimpleNamespace(temperature=temperature, sample_top_k=k)
            try:
                inference.check_sample_top_k(cfg, [spec], paths)
                got = None
            except SystemExit as e:
                got = str(e.code)
                refused.append(got)
            if want is None:
                assert got is None, f"temperature {temperature}, k {k}, {paths}: refused"
            else:
                assert got is not None and want in got and "at most 5" in got, f"temperature {temperature}, k {k}: {got}"
    return "; ".join(refused)[:160]


add("inference/sample_top_k_limit", inference_sample_top_k_limit, gpu=False)


@mutant("sample_top_k_unchecked", "inference/sample_top_k_limit")
def _sample_top_k_unchecked():
    with unittest.mock.patch.object(inference, "check_sample_top_k", lambda cfg, specs, paths: None):
        yield


@mutant("megakernel_takes_any_model", "inference/megakernel_refuses")
def _megakernel_takes_any_model():
    with unittest.mock.patch.object(inference, "megakernel_why_not", lambda model: None):
        yield  # no reason asked: a hyper-connection model goes on to the kernel
add("inference/gpu_megakernel_refuses_shapes", inference_gpu_megakernel_refuses_shapes)


@mutant("megakernel_limits_unchecked", "inference/gpu_megakernel_refuses_shapes")
def _megakernel_limits_unchecked():
    with unittest.mock.patch.object(kernels, "decode_megakernel_why_not", lambda *args, **kwargs: None):
        yield  # kernels.cu's shape limits not asked: the models past them go on to the launch


# ==== script tests: mHC on the CPU ====
# the incrementing-token task, the composite gains, the residual variants, the depth sweep


def data_call_timer(device="cpu"):
    """CallTimer times each call alone (the time between calls is not counted) and totals the calls past skip."""
    dev = torch.device(device)
    timer, x = data.CallTimer(dev, skip=2), torch.ones(1 << 16, device=dev)
    for _ in range(5):
        timer.time(torch.mul, x, 2.0)
        time.sleep(0.05)  # between calls: not counted
    dt, n = timer.stop()
    assert n == 5 and timer.timed_steps == 3, f"{n} calls in the window, {timer.timed_steps} counted"
    assert 0 < timer.timed_s <= dt < 0.1, f"counted {timer.timed_s} s of a window of {dt} s: were the sleeps timed?"
    assert timer.stop() == (0.0, 0), "a second window without calls is not empty"
    return f"5 calls, 3 counted: {1e6 * timer.timed_s:.0f} us of {1e6 * dt:.0f} us; the 250 ms of sleeps not counted"


def data_increment_batch():
    B, T, V = 64, 200, data.INCREMENT_VOCAB
    x, y = data.increment_batch(B, T, torch.Generator().manual_seed(0))
    assert x.shape == (B, T) and y.shape == (B, T), f"shapes {x.shape} {y.shape}"
    assert x.dtype == torch.int64 and y.dtype == torch.int64, f"dtypes {x.dtype} {y.dtype}"
    assert torch.equal(x, (x[:, :1] + torch.arange(T)) % V), "rows do not count up by one mod 256"
    assert torch.equal(y, (x + 1) % V), "y is not x one token ahead"
    assert int(x.min()) >= 0 and int(x.max()) <= V - 1, "ids outside 0..255"
    assert ((x[:, :-1] == V - 1) & (x[:, 1:] == 0)).any(), "no row wraps from 255 to 0"
    assert len(set(x[:, 0].tolist())) > B // 2, "starts are not spread"
    x2, _ = data.increment_batch(B, T, torch.Generator().manual_seed(0))
    x3, _ = data.increment_batch(B, T, torch.Generator().manual_seed(1))
    assert torch.equal(x, x2) and not torch.equal(x, x3), "batches do not follow the seed"
    return f"({B}, {T}) rows (s, s+1, ...) mod {V}, seeded"


def mhc_composite_gains_known():
    eye = torch.eye(4)
    g = mhc.composite_gains([eye, eye, eye])
    assert all(abs(v) < 1e-12 for v in g.values()), f"identity: {g}"
    # P = H1 @ H0 = [[1, 2], [3, 7]] (H0 applies first): max entry 7, row sums 3 and 10, column sums 4 and 9
    h0, h1 = torch.tensor([[1.0, 2.0], [0.0, 1.0]]), torch.tensor([[1.0, 0.0], [3.0, 1.0]])
    g = mhc.composite_gains([h0, h1])
    want = {"proxy": math.log10(7), "fwd": 1.0, "bwd": math.log10(9)}
    assert all(abs(g[k] - want[k]) < 1e-12 for k in want), f"2x2 product: {g}, expected {want}"
    # absolute values, and per token (B, T, n, n) against a static (n, n): the max over tokens
    tok = eye.expand(2, 3, 4, 4).clone()
    tok[1, 2] = torch.diag(torch.tensor([-5.0, 1.0, 1.0, 1.0]))
    g = mhc.composite_gains([2 * eye, tok])
    assert all(abs(g[k] - 1.0) < 1e-12 for k in g), f"per token: {g}, expected log10(10) = 1"
    assert mhc.composite_gains([]) is None, "baseline has no gains"
    t = mhc.composite_gain_tensor([h0, h1])
    assert t.shape == (3,) and t.dtype == torch.float64, f"{t.shape} {t.dtype}"
    return "identity 0, [[1,2],[3,7]] -> proxy log10 7, fwd 1, bwd log10 9; per-token max"


def mhc_twins_fp32_under_autocast():
    # under --dtype=bf16 the stream twins keep fp32 math (autocast would round h_res @ x and the projection to
    # bf16): under autocast, with a bf16 y, they give the fp32 result bit for bit, as the stream kernels do
    x, h_res, h_post, h_pre = torch.randn(3, 5, 4, 16), torch.randn(4, 4), torch.randn(4), torch.randn(4)
    y = torch.randn(3, 5, 16).to(torch.bfloat16)
    w, phi = torch.randn(64), torch.randn(24, 64)
    want = (mhc.stream_mix_merge_torch(x, h_res, h_post, y.float(), h_pre), mhc.hc_project_torch(x.flatten(-2), w, phi))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = (mhc.stream_mix_merge_torch(x, h_res, h_post, y, h_pre), mhc.hc_project_torch(x.flatten(-2), w, phi))
    for name, a, b in zip(("mixed", "merged", "projection"), (*got[0], got[1]), (*want[0], want[1])):
        assert a.dtype == torch.float32 and torch.equal(a, b), f"{name}: {a.dtype}, max diff {(a.float() - b).abs().max()}"
    return "stream_mix_merge and hc_project twins: fp32 and bit-equal under autocast(bf16)"


def _tiny_gpt(variant, layers=2):
    return train.GPT(data.INCREMENT_VOCAB, 16, 32, 2, layers, 0, train.TORCH_OPS, residual=variant, n_streams=4)


def _opt(model, lr):
    return train.make_optimizer(model, types.SimpleNamespace(lr=lr, weight_decay=0.0, beta1=0.9, beta2=0.99),
                                False, False)


def mhc_doubly_stochastic_after_step():
    g = torch.Generator().manual_seed(0)
    for variant in ("mhc", "mhc-dynamic"):
        model = _tiny_gpt(variant)
        opt = _opt(model, 1e-1)  # large steps move the mixing far from its start
        for _ in range(2):
            train.train_step(model, opt, *data.increment_batch(4, 16, g))
        with torch.no_grad():
            model(*data.increment_batch(4, 16, g))  # H_res of the updated weights
        h = torch.stack(mhc.residual_maps(model)).double()  # (2L, [B, T,] 4, 4)
        assert (h >= 0).all(), f"{variant}: negative entry"
        check(f"{variant}_rows", h.sum(-1), torch.ones_like(h.sum(-1)), 1e-6)
        check(f"{variant}_cols", h.sum(-2), torch.ones_like(h.sum(-2)), 1e-4)
        if variant == "mhc":
            moved = (model.streams.mixing.res_logits[1] - (2 * torch.eye(4) - 1)).abs().max().item()
            assert moved > 1e-2, f"H_res logits moved only {moved:.1e}: nothing was tested"


def train_variants_few_steps():
    g = torch.Generator().manual_seed(0)
    losses = {}
    for variant in mhc.VARIANTS:
        model = _tiny_gpt(variant)
        opt = _opt(model, 2e-3)
        losses[variant] = [train.train_step(model, opt, *data.increment_batch(4, 16, g)).item()]
        if variant != "baseline":
            # The streams start as copies of the embedding; unless the sublayers read them differently, the
            # first gradient of the mixing is rounding noise (~1e-11) and the streams stay alike.
            mix = (mhc.residual_modules(model)[0].bias.grad if variant == "mhc-dynamic"
                   else model.streams.mixing.post_logits.grad[0])  # the first sublayer's
            assert mix.abs().max() > 1e-8, f"{variant}: first mixing gradient {mix.abs().max():.1e}"
        losses[variant] += [train.train_step(model, opt, *data.increment_batch(4, 16, g)).item() for _ in range(2)]
        assert all(math.isfinite(v) for v in losses[variant]), f"{variant}: {losses[variant]}"
    return " ".join(f"{v} {ls[-1]:.3f}" for v, ls in losses.items())


def _train_main_ok(*args):
    """train.main(args) in this process (no second PyTorch import): its output, or AssertionError if it exits."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            train.main(list(args))
    except SystemExit as e:
        raise AssertionError(f"train.py {' '.join(args)} exited: {e}\n{out.getvalue()[-2000:]}") from None
    return out.getvalue()


_SWEEP_TINY = ["--preset=mhc", "--device=cpu", "--sweep_depths=2", "--n_embd=32", "--n_head=2", "--block_size=16",
               "--batch_size=4", "--max_iters=6", "--log_interval=3", "--timing_warmup=0"]


def train_mhc_sweep_cpu():
    with tempfile.TemporaryDirectory() as tmp:
        out = _train_main_ok(*_SWEEP_TINY, f"--out_dir={tmp}")
        rows = [line for line in out.splitlines() if line.startswith("| ")]
        assert len(rows) == 1 + len(mhc.VARIANTS), f"table:\n{out}"
        assert "final loss" in rows[0] and "gain fwd" in rows[0] and "ms/step" in rows[0], rows[0]
        assert [r.split("|")[1].strip() for r in rows[1:]] == list(mhc.VARIANTS), rows
        assert "step 3/6" in out and "eta" in out, f"no progress lines in:\n{out}"
        with open(os.path.join(tmp, "results.json")) as f:
            cells = json.load(f)["cells"]
        assert sorted(cells) == sorted(f"{v}/2" for v in mhc.VARIANTS), sorted(cells)
        for v in mhc.VARIANTS:
            c = cells[f"{v}/2"]
            assert c["steps"] == 6 and c["diverged_at"] is None and c["nonfinite_steps"] == 0, (v, c["steps"])
            assert all(math.isfinite(x) for x in c["per_step"]["loss"]), f"{v}: {c['per_step']['loss']}"
            assert c["ms_per_step"] and c["timed_steps"] == 2, f"{v}: {c['ms_per_step']} {c['timed_steps']}"
            gains = [c["final"][f"gain_{g}"] for g in mhc.GAINS]
            if v == "baseline":
                assert gains == [None] * 3 and "gain_fwd" not in c["per_step"], f"baseline gains {gains}"
            else:
                assert all(x is not None and math.isfinite(x) for x in gains), f"{v} gains {gains}"
                assert len(c["per_step"]["gain_fwd"]) == 6, f"{v}: gains per step"
        for v in ("mhc", "mhc-dynamic"):  # doubly stochastic: row sums 1, so the forward gain is log10 1
            assert abs(cells[f"{v}/2"]["final"]["gain_fwd"]) < 1e-4, cells[f"{v}/2"]["final"]
        # hc starts from exp(2I - 1), rows summing to e + 3/e: 4 sublayers give log10 (e + 3/e)^4 = 2.33
        assert cells["hc/2"]["final"]["gain_fwd"] > 1.5, cells["hc/2"]["final"]
        for png in ("loss_per_step.png", "gain_vs_depth.png", "gain_per_step.png"):
            assert os.path.getsize(os.path.join(tmp, png)) > 1000, f"no {png}"

        out = _train_main_ok(*_SWEEP_TINY, f"--out_dir={tmp}", "--plot=false")
        assert out.count("skipping") == len(mhc.VARIANTS) and "L2: training" not in out, out
        assert [line for line in out.splitlines() if line.startswith("| ")] == rows, "rerun table differs"
        with open(os.path.join(tmp, "results.json")) as f:
            assert json.load(f)["cells"] == cells, "the rerun changed results.json"
        # fp32 cells are no bf16 results: a bf16 sweep into the same folder is refused, not skipped
        _train_fails("bf16 sweep over fp32 results", ("other settings", "dtype"), *_SWEEP_TINY, f"--out_dir={tmp}",
                     "--dtype=bf16")
    return f"{len(cells)} cells, rerun skipped them all; a bf16 rerun refused"


def train_short_validation_split():
    """A validation split no longer than the context ends train.py and the book sweep (--preset=mhc-text) in one
    line before anything trains, not in a traceback from the first evaluation."""
    with tempfile.TemporaryDirectory() as tmp:
        path, out = os.path.join(tmp, "short.txt"), os.path.join(tmp, "out")
        with open(path, "w") as f:
            f.write("the tin woodman and the lion " * 10)  # 290 characters: 29 for validation
        words = ("validation split", f"--data_path={path}", "29 tokens", "--block_size=32")
        sweep = ["--preset=mhc-text", "--device=cpu", "--sweep_depths=1", "--sweep_variants=baseline", "--n_embd=16",
                 "--n_head=2", "--batch_size=2", "--max_iters=2", "--log_interval=1", "--eval_iters=1", "--plot=false"]
        for what, args in (("mhc-text", sweep), ("train.py", [*_TRAIN_TINY, "--max_iters=2"])):
            code, log = _train_main(*args, "--block_size=32", f"--data_path={path}", f"--out_dir={out}")
            assert isinstance(code, str) and code.startswith("train.py: error: ") and "\n" not in code, \
                f"{what}: expected one error line, got exit {code!r}\n{log[-1500:]}"
            assert all(w in code for w in words), f"{what}: {[w for w in words if w not in code]} not in: {code}"
            began = [s for s in ("mHC sweep on", "training, batch", "op sets:", "iter 1") if s in log]
            assert not began and os.listdir(out) == [], f"{what}: training began: {began} {os.listdir(out)}"
    return "mhc-text and train.py: one line before training"


@mutant("split_shorter_than_context_unchecked", "train/short_validation_split")
def _split_lengths_unchecked():
    """data.read_text_splits without its check of the splits' lengths against --block_size."""
    real = data.read_text_splits
    unchecked = lambda data_path, block_size, fail: real(data_path, 0, fail)  # noqa: E731
    with unittest.mock.patch.object(train, "read_text_splits", unchecked), \
            unittest.mock.patch.object(mhc, "read_text_splits", unchecked):
        yield


def train_mhc_sweep_diverging_cell():
    """A cell whose loss turns NaN stops at the next log point and is marked; a rerun with other settings
    is refused rather than mixed into the same results.json."""
    with contextlib.redirect_stdout(io.StringIO()):
        cfg = train.parse_config(_SWEEP_TINY + ["--lr=1e4"])  # exp(res_logits) of hc overflows after step 1
    task = mhc.sweep_task(cfg, torch.device("cpu"), train.SWEEP_TRAINER)
    c = mhc.sweep_cell(cfg, train.TORCH_OPS, task, "hc", 2, 4, train.SWEEP_TRAINER)
    assert c["diverged_at"] == 2 and c["steps"] == 3 and c["final"]["loss"] is None, (c["diverged_at"], c["steps"])
    assert c["per_step"]["nonfinite"][0] == 0 and c["per_step"]["nonfinite"][1] > 0, c["per_step"]["nonfinite"]
    table = mhc.sweep_table({"hc/2": c})
    assert "stopped at 3" in table[2] and "nan" in table[2], table[2]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "results.json")
        with open(path, "w") as f:
            json.dump({"settings": {"lr": 0.002}, "cells": {}}, f)
        try:
            mhc.load_sweep(path, {"lr": 10000.0}, train.fail)
        except SystemExit as e:
            assert "other settings" in str(e) and "lr" in str(e), str(e)
        else:
            raise AssertionError("results made with other settings were accepted")
    return "hc at lr 1e4: NaN from step 2, stopped at 3"


def train_mhc_sweep_interrupted():
    """Ctrl-C in the second cell of a sweep: that cell stops after its step and is kept, marked interrupted, beside
    the finished one; exit 130 with a line that says where and what is kept. The next run skips the finished cell
    and trains the interrupted one again."""
    real, calls = train.SWEEP_TRAINER.train_step, []

    def step(*args):  # the real step; Ctrl-C during the second cell's second one
        calls.append(1)
        if len(calls) == 8:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args)
    args = [*_SWEEP_TINY, "--sweep_variants=baseline,mhc", "--plot=false"]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "results.json")
        try:
            with unittest.mock.patch.object(train.SWEEP_TRAINER, "train_step", step):
                code, out = _train_main(*args, f"--out_dir={tmp}")
        except KeyboardInterrupt:
            raise AssertionError("Ctrl-C in a cell left train.main as a KeyboardInterrupt") from None
        assert code == 130, f"exit {code!r}\n{out[-1500:]}"
        assert (f"train.py: interrupted by Ctrl-C (SIGINT) at step 2 of 6 of mhc L2 (its steps so far are kept, marked "
                f"interrupted; the next run trains it again); {path} holds the 1 finished cell(s)") in out, out[-1500:]
        with open(path) as f:
            cells = json.load(f)["cells"]
        assert cells["baseline/2"]["steps"] == 6 and cells["baseline/2"]["interrupted"] is None, cells["baseline/2"]
        assert cells["mhc/2"]["steps"] == 2 and cells["mhc/2"]["interrupted"] == "Ctrl-C (SIGINT)", cells["mhc/2"]
        assert len(cells["mhc/2"]["per_step"]["loss"]) == 2, cells["mhc/2"]["per_step"]
        out = _train_main_ok(*args, f"--out_dir={tmp}")
        assert "baseline L2: already in" in out and "mhc L2: interrupted at step 2, training again" in out, out
        with open(path) as f:
            cells = json.load(f)["cells"]
        assert cells["mhc/2"]["steps"] == 6 and cells["mhc/2"]["interrupted"] is None, cells["mhc/2"]
    return "cell mhc L2 kept at step 2 of 6, marked; the rerun trained it again, skipping baseline"


@mutant("sweep_cell_lost_on_ctrl_c", "train/mhc_sweep_interrupted")
def _sweep_cell_lost_on_ctrl_c():
    """Ctrl-C raises KeyboardInterrupt in the cell: the cell in flight is lost."""
    class Unhandled(data.StopRequest):
        def __enter__(self):
            self.previous = {}
            return self
    with unittest.mock.patch.object(mhc, "StopRequest", Unhandled):
        yield


def train_residual_option():
    with tempfile.TemporaryDirectory() as tmp:
        data_file, out = _train_text_file(tmp), os.path.join(tmp, "out")
        _train_main_ok(*_TRAIN_TINY, f"--data_path={data_file}", f"--out_dir={out}", "--max_iters=2",
                    "--residual=mhc-dynamic", "--n_streams=3")
        ck = _train_load_ckpt(os.path.join(out, "ckpt_torch.pt"))
        assert ck["config"]["residual"] == "mhc-dynamic" and ck["config"]["n_streams"] == 3, ck["config"]
        assert any("phi_w" in k for k in ck["model"]), "the checkpoint has no mhc-dynamic weights"
    for bad, words in ((["--residual=mhx"], ("--residual", "mhc-dynamic")), (["--sweep_depths=12,x"], ("depth",)),
                       (["--sweep_variants=mhc,mhc"], ("distinct",))):
        try:
            mhc.check_config(train.parse_config(bad), train.fail)
        except SystemExit as e:
            assert all(w in str(e) for w in words), str(e)
        else:
            raise AssertionError(f"{bad} was accepted")
    return "--residual=mhc-dynamic --n_streams=3 trains and is checkpointed; bad residual and sweep keys rejected"


add("data/call_timer_cuda", data_call_timer, "cuda")
for _fn in (data_call_timer, data_increment_batch, mhc_composite_gains_known, mhc_twins_fp32_under_autocast,
            mhc_doubly_stochastic_after_step, train_variants_few_steps, train_mhc_sweep_cpu,
            train_short_validation_split, train_mhc_sweep_diverging_cell, train_mhc_sweep_interrupted,
            train_residual_option):
    add(_fn.__name__.replace("_", "/", 1), _fn, gpu=False)


# ==== script tests: the README's commands ====
# run as a newcomer runs them: in order, on a fresh copy of the repo


README_TINY = {  # appended to each README command this test runs: the CPU, tiny sizes, a few steps
    "train.py": ["--device=cpu", "--max_iters=3", "--eval_interval=3", "--eval_iters=1", "--log_interval=3",
                 "--batch_size=2", "--block_size=16", "--n_embd=32", "--n_head=2", "--n_layer=1", "--sample_len=10",
                 "--plot=false", "--sweep_depths=2", "--sweep_variants=baseline,mhc", "--timing_warmup=0",
                 "--warmup_iters=1"],  # shorter than the 3 steps (the large preset's is 100)
    "inference.py": ["--device=cpu", "--n_layer=1", "--n_embd=32", "--n_head=2", "--block_size=24", "--n_expert=2",
                     "--top_k=1", "--seeds=0", "--max_new_tokens=8", "--prompt=the"],
}


def readme_commands():
    """The README's shell commands in order: each line of its indented blocks that starts with pip, python or
    torchrun, split at &&, as (argv, the line's comment)."""
    commands = []
    with open(os.path.join(HERE, "README.md")) as f:
        for line in f:
            if re.match(r"    (pip|python|torchrun) ", line):
                argv, comment = shlex.split(line, comments=True), line.partition(" # ")[2].strip()
                while argv:
                    first = argv.index("&&") if "&&" in argv else len(argv)
                    commands.append((argv[:first], comment))
                    argv = argv[first + 1:]
    return commands


def readme_commands_in_order():
    # Every README command that runs on a CPU, run as written plus README_TINY, in the README's order, in a copy of
    # the repo's tracked files: none may be refused (a collision on out/ was); the others are listed with a reason.
    with tempfile.TemporaryDirectory() as tmp:
        clone = os.path.join(tmp, "clone")
        tracked = subprocess.run(["git", "ls-files"], cwd=HERE, capture_output=True, text=True).stdout.split()
        for name in tracked or [f for f in os.listdir(HERE) if f.endswith((".py", ".md", ".txt"))]:
            os.makedirs(os.path.dirname(os.path.join(clone, name)), exist_ok=True)
            shutil.copy(os.path.join(HERE, name), os.path.join(clone, name))
        book, extra = os.path.join(HERE, "data_cache", data.CACHE_NAME), []
        if os.path.isfile(book):  # as the README says to, without network
            os.makedirs(os.path.join(clone, "data_cache"))
            shutil.copy(book, os.path.join(clone, "data_cache"))
        else:
            extra = [f"--data_path={_train_text_file(tmp)}"]
        ran, skipped = [], []
        for argv, comment in readme_commands():
            line = shlex.join(argv)
            why = ("installs packages" if argv[0] == "pip" else
                   "GPU only (says the README)" if "GPU only" in comment else
                   "the suite this case runs in" if argv[1:] == ["test_ops.py"] else
                   "builds the extension (minutes)" if "setup.py" in argv and torch.version.cuda else None)
            if why:
                skipped.append(f"`{line}`: {why}")
                continue
            script = next(a for a in argv if a.endswith(".py"))
            launch = [sys.executable] if argv[0] == "python" else [sys.executable, "-m", "torch.distributed.run"]
            tiny = README_TINY.get(script, []) + (extra if script == "train.py" else [])
            p = subprocess.run([*launch, *argv[1:], *tiny], cwd=clone, capture_output=True, text=True, timeout=600)
            last = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""
            assert p.returncode == 0, f"README command {len(ran) + len(skipped) + 1}, `{line}`: exit {p.returncode}: " \
                                      f"{[ln for ln in p.stderr.splitlines() if 'error' in ln][:1] or last}"
            ran.append(line)
        assert any("torchrun" in c for c in ran) and len(ran) >= 8, ran
        results = sorted(f for f in os.listdir(os.path.join(clone, "out")) if f.startswith("inference"))
        assert results == ["inference.json", "inference_2.json"], results
    return f"{len(ran)} run in order, none refused; skipped: " + "; ".join(skipped)


@mutant("readme_commands_share_out_dir", "readme/commands_in_order")
def _readme_commands_share_out_dir():
    """The README's commands as they were: no --out_dir of their own, every run into out/."""
    real = readme_commands
    with unittest.mock.patch.object(sys.modules[__name__], "readme_commands",
                                    lambda: [([a for a in argv if not a.startswith("--out_dir=")], c)
                                             for argv, c in real()]):
        yield


add("readme/commands_in_order", readme_commands_in_order, gpu=False)


# ==== script tests: test_ops.py --bench without a GPU (CPU) ====
# the advice must fit the machine


def bench_without_gpu():
    g = globals()
    saved = {k: g[k] for k in ("HAS_CUDA", "kernels", "KERNELS_ERROR")}
    try:
        for has_cuda, words, not_words in ((False, ("needs an NVIDIA GPU",), ("build_ext",)),
                                           (True, ("needs the built extension", "build_ext --inplace"), ())):
            g.update(HAS_CUDA=has_cuda, kernels=None, KERNELS_ERROR=ImportError("No module named 'kernels'"))
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                code = bench_main(None)
            text = out.getvalue()
            assert code == 1, f"--bench exited {code} (GPU: {has_cuda})"
            assert all(w in text for w in words) and not any(w in text for w in not_words), text
    finally:
        g.update(saved)
    return "no GPU: says a GPU is needed; GPU without build: says to build"


add("bench/without_gpu", bench_without_gpu, gpu=False)


# ==== script tests: the references themselves (CPU), and --sanitize's logs ====
# the GPU cases lean on the references' rules; the sanitizer's summaries are read from canned logs


def ref_topk_order():
    # the torch op set's top-k (the router's and the sampler's twin) orders ties by lower index, NaN first
    nan = float("nan")
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0] * 4, [1.0, nan, 3.0, nan, -0.0] * 4, [0.0] + [1.0] * 19])
    values, idx = train.TORCH_OPS.topk(x, 3)
    assert idx.tolist() == [[1, 2, 4], [1, 3, 6], [1, 2, 3]], f"unexpected order {idx.tolist()}"
    assert values[0].tolist() == [3.0] * 3 and values[1, :2].isnan().all(), values
    return "ties by lower index, NaN first"


@mutant("torch_topk_ties_unordered", "ref/topk_order")
def _torch_topk_ties_unordered():
    with unittest.mock.patch.object(train.TORCH_OPS, "topk", torch.topk):
        yield


def ref_causal_alignment():
    q, k, v = (torch.randn(1, 2, S, 8, dtype=torch.float64) for S in (3, 5, 5))
    for Sk in (5, 3):
        i, j = torch.arange(3)[:, None], torch.arange(Sk)[None, :]
        scores = (q @ k[..., :Sk, :].transpose(-1, -2) / math.sqrt(8)).masked_fill(j > i + Sk - 3, -math.inf)
        check(f"Sq3_Sk{Sk}", REF.attention(q, k[..., :Sk, :], v[..., :Sk, :], causal=True),
              torch.softmax(scores, -1) @ v[..., :Sk, :], 1e-12)


def ref_join_last():
    """train.join_last, the cuda op set's join of split gradients: parts side by side in one tensor come
    back as a view of it (no copy); any other parts as torch.cat would give them."""
    base = torch.randn(2, 5, 12)
    for parts, joins in ((base.split([4, 4, 4], -1), True), (base.split([3, 4, 5], -1)[:2], True),
                         ([t.clone() for t in base.split([4, 4, 4], -1)], False),  # apart
                         ([base[..., :4], base[..., 8:]], False),                  # a gap between
                         ([base[..., 4:8], base[..., :4]], False),                 # out of order
                         ([base[0, :, :4], base[1, :, 4:8]], False)):              # different rows
        joined = train.join_last(list(parts))
        check(f"{len(parts)}_parts", joined, torch.cat(parts, -1), 0)
        assert (joined.data_ptr() == parts[0].data_ptr()) == joins, f"joined in place: expected {joins}"
    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: train.JoinedSplit.apply(x, [2, 5]), (x,))
    return "side by side: a view; otherwise a copy; JoinedSplit passes gradcheck"


def ref_embedding():
    # the reference's index_select equals F.embedding in value and weight gradient, repeated indices too
    idx = torch.tensor([[3, 0, 3], [1, 3, 2]])
    w = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, 3, 4, dtype=torch.float64)
    ours, twin = embedding_reference(idx, w), F.embedding(idx, w)
    check("out", ours, twin, 0)
    check("dw", torch.autograd.grad(ours, w, dy)[0], torch.autograd.grad(twin, w, dy)[0], 1e-15)


def ref_check_nonfinite():
    # the NaN and inf cases' checker fails on every way of getting them wrong, and passes the right ones
    nan, inf = float("nan"), float("inf")
    ref = torch.tensor([1.0, nan, inf, -inf])
    check_nonfinite("same", ref.clone(), ref, 0.0)
    for fault, ours in (("NaN moved", [nan, 1.0, inf, -inf]), ("NaN as a number", [1.0, 0.0, inf, -inf]),
                        ("inf as NaN", [1.0, nan, nan, -inf]), ("inf's sign", [1.0, nan, -inf, -inf]),
                        ("a finite value off", [1.5, nan, inf, -inf])):
        raised_message(AssertionError, lambda: check_nonfinite(fault, torch.tensor(ours), ref, 0.1), f" for {fault}")
    return "fails on a NaN or inf moved, lost or changed and on a finite value off"


SANITIZER_LOG = """========= COMPUTE-SANITIZER
embedding/x                                    PASS  out 0
========= Uninitialized __global__ memory read of size 2 bytes
=========     at void at::native::(anonymous namespace)::unrolled_elementwise_kernel<4>(int)+0x3c0 in Loops.cuh:33
=========     by thread (0,0,0) in block (0,0,0)
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: embedding_bwd in kernels.cu
=========
========= Error: Race reported between Write access at void norm_bwd_kernel<32>(NormBwdArgs)+0x4d0 in /r/kernels.cu:900
=========     and Read access at void norm_bwd_kernel<32>(NormBwdArgs)+0x2a0 in /r/kernels.cu:880 [8 hazards]
=========
========= Internal Sanitizer Error: The Sanitizer failed to handle a hardware exception.
=========
matmul_bf16/1x1x1                              FAIL  RuntimeError: CUBLAS_STATUS_INTERNAL_ERROR
1 passed, 1 failed, 0 skipped
========= ERROR SUMMARY: 3 errors
"""


def sanitizer_summary_of_logs():
    # --sanitize's reading of a log: which kernel each report is in, ours (a kernels.cu frame on the device
    # side, not a host frame) or not, and the counts it keeps once it has cut a long log short
    reports = sanitizer_reports(SANITIZER_LOG)
    want = [(False, "unrolled_elementwise_kernel"), (True, "norm_bwd_kernel"),
            (False, "Internal Sanitizer Error: The Sanitizer failed to handle a hardware exception.")]
    assert [(o, w) for o, w, _ in reports] == want, f"read as {reports}"
    with tempfile.TemporaryDirectory() as tmp:
        lines = SANITIZER_LOG.splitlines(keepends=True)
        proc = types.SimpleNamespace(stdout=lines[:2] + lines[2:8] * 31 + lines[8:])  # the first report 31 times
        keep_sanitizer_log(proc, os.path.join(tmp, "initcheck_0.log"))
        text = open(os.path.join(tmp, "initcheck_0.log")).read()
        assert "TALLY other 31 unrolled_elementwise_kernel" in text and "TALLY ours 1 norm_bwd_kernel" in text, text
        assert text.count("unrolled_elementwise_kernel<4>") == SANITIZER_KEEP, "the log keeps SANITIZER_KEEP of them"
        with contextlib.redirect_stdout(io.StringIO()) as out:
            failed = print_sanitizer_summary(tmp)
    assert failed == 1 and "OURS  1 in norm_bwd_kernel" in out.getvalue(), out.getvalue()
    return "reports by kernel, ours told apart, long logs tallied"


def sanitizer_left_out():
    # a case a tool leaves out (tool_cases) is neither run nor counted, though an older log holds its verdict
    names = ["a/1", "train/gpu_bf16_op_sets_close_llama", "matmul_bf16/1x1x1"]
    assert tool_cases("racecheck", names) == ["a/1", "matmul_bf16/1x1x1"], tool_cases("racecheck", names)
    assert tool_cases("initcheck", names) == ["a/1"] and tool_cases("memcheck", names) == names
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "racecheck_0.log"), "w") as f:
            f.write("a/1  PASS\nmatmul_bf16/1x1x1  PASS\n"
                    "train/gpu_bf16_op_sets_close_llama  ========= Error: process didn't terminate successfully\n")
        with contextlib.redirect_stdout(io.StringIO()) as out:
            failed = print_sanitizer_summary(tmp, expected=names)
            runs = sanitizer_commands("racecheck", [], 2, "", tmp, names)
    row = out.getvalue().splitlines()[2].split()
    assert failed == 0 and row[:6] == ["racecheck", "2", "2", "0", "0", "0"] and runs == [], out.getvalue()
    return "left out of racecheck: the bf16 op-set cases; an older DIED verdict of one is not counted"


def sanitizer_resume():
    # a later run's verdict replaces an earlier one's, a case a log ends inside counts as DIED (and runs
    # alone when resumed), cases no log names count as missing, and logs of another kernels.cu are not resumed
    with tempfile.TemporaryDirectory() as tmp:
        logs = ["a/1  FAIL  x\nb/2  PASS\nd/4  ========= Error: process didn't terminate successfully\n",
                "a/1  \na/1  PASS  y\n"]
        for k, text in enumerate(logs):
            with open(os.path.join(tmp, f"racecheck_{k}.log"), "w") as f:
                f.write(text)
        assert case_verdicts(sanitizer_logs(tmp, "racecheck")) == {"a/1": "PASS", "b/2": "PASS", "d/4": "DIED"}
        with contextlib.redirect_stdout(io.StringIO()) as out:
            failed = print_sanitizer_summary(tmp, expected=["a/1", "b/2", "c/3", "d/4"])
        row = out.getvalue().splitlines()[2].split()
        assert failed == 1 and row[:6] == ["racecheck", "3", "2", "1", "0", "1"], out.getvalue()
        assert "racecheck_0.log: d/4 DIED" in out.getvalue(), out.getvalue()
        # a resumed run: c/3 on the shared processes, d/4, which died, on one of its own
        with contextlib.redirect_stdout(io.StringIO()):
            runs = sanitizer_commands("racecheck", [], 2, "", tmp, ["a/1", "b/2", "c/3", "d/4"])
        skips = [open(cmd[cmd.index("--skip_file") + 1]).read().split() for _, cmd, _ in runs]
        assert [name for name, _, _ in runs] == ["racecheck_2", "racecheck_3", "racecheck_4"], runs
        assert skips == [["a/1", "b/2", "d/4"]] * 2 + [["a/1", "b/2", "c/3"]], skips
        check_sanitizer_logs_match(tmp)
        with open(os.path.join(tmp, "sources"), "w") as f:
            f.write("another build\n")
        try:
            check_sanitizer_logs_match(tmp)
        except SystemExit as e:
            assert "another kernels.cu" in str(e), e
        else:
            raise AssertionError("logs of another build were resumed")
    return "later verdicts win, a case its process died in counted as failed and rerun alone, missing cases " \
           "counted, logs of another build refused"


add("ref/topk_order", ref_topk_order, gpu=False)
add("ref/causal_alignment", ref_causal_alignment, gpu=False)
add("ref/join_last", ref_join_last, gpu=False)
add("ref/embedding", ref_embedding, gpu=False)
add("ref/check_nonfinite", ref_check_nonfinite, gpu=False)
add("sanitize/summary_of_logs", sanitizer_summary_of_logs, gpu=False)
add("sanitize/resume", sanitizer_resume, gpu=False)
add("sanitize/left_out", sanitizer_left_out, gpu=False)


# ==== script tests: train.py on the GPU ====
# the training step reproduces itself bit for bit, the two op sets train alike, and so does the
# compiled torch step (--compile). All run train.train_op_set, the loop of `python train.py` (the cuda
# op set graphed, as by default), on a generated text, so they never skip for want of the book.


def gpu_train_text(n_words=4000):
    """About 24,000 characters: words of random letters and digits, sentences of 12 words ending in
    '.' and a line break. 65 distinct characters."""
    g = torch.Generator().manual_seed(0)
    alphabet = string.ascii_letters + string.digits
    lengths = torch.randint(1, 9, (n_words,), generator=g).tolist()
    picks = iter(torch.randint(0, len(alphabet), (sum(lengths),), generator=g).tolist())
    return "".join("".join(alphabet[next(picks)] for _ in range(n)) + (".\n" if k % 12 == 11 else " ")
                   for k, n in enumerate(lengths))


def gpu_train(ops, out_dir, **overrides):
    """train.train_op_set on gpu_train_text with train.py's defaults and these overrides: its result,
    and the checkpoint it writes after its last step (weights and optimizer state), checksum verified."""
    cfg = types.SimpleNamespace(**{**train.DEFAULTS, "device": DEV, "out_dir": out_dir, "world_size": 1, "eval_iters": 2,
                                   "sample_len": 0, "plot": False, **overrides})
    text = gpu_train_text()
    tok = data.CharTokenizer(text)
    assert tok.vocab_size == 65, f"vocabulary of {tok.vocab_size} characters"
    train_ids, val_ids = data.split_data(torch.tensor(tok.encode(text), dtype=torch.long))
    os.makedirs(out_dir)
    with warnings.catch_warnings():  # as train.main: graphed AdamW's eager warm-up steps warn, harmlessly
        warnings.filterwarnings("ignore", message="This instance was constructed with capturable=True")
        r = train.train_op_set(ops, cfg, tok, train_ids.to(DEV), val_ids.to(DEV))
    assert r["status"] == "completed" and r["iters"] == cfg.max_iters, \
        f"{ops.name}: {r['status']} after {r['iters']} steps ({r['stopped_because']})"
    assert r["checkpoint_iter"] == cfg.max_iters, f"{ops.name}: checkpoint at iteration {r['checkpoint_iter']}"
    return r, data.read_checkpoint(r["ckpt_path"])


def run_tensors(ckpt):
    """Every tensor a training run leaves behind, by name: the weights and AdamW's state."""
    out = {f"model.{k}": v for k, v in ckpt["model"].items()}
    for i, state in ckpt["optimizer"]["state"].items():
        out.update({f"optimizer.{i}.{k}": v for k, v in state.items() if torch.is_tensor(v)})
    return out


def bits(t):
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def train_gpu_deterministic(residual, arch="gpt"):
    # Two graphed runs of the cuda op set, one seed, one batch order: every loss, every eval loss,
    # every weight and every AdamW moment must agree to the bit after 10 steps (3 eager warm-up
    # steps, the capture, 7 replays; 5 steps under a tool).
    shape = dict(n_layer=3, n_head=2, n_embd=64, block_size=64, batch_size=8, max_iters=under_tool(10, 5),
                 residual=residual, arch=arch)
    ops = train.cuda_op_set(kernels, shape["n_embd"] // shape["n_head"])
    with tempfile.TemporaryDirectory() as tmp:
        (r1, c1), (r2, c2) = [gpu_train(ops, os.path.join(tmp, f"run{i}"), **shape) for i in (1, 2)]
    assert r1["mode"] == r2["mode"] == "graph", f"modes {r1['mode']}, {r2['mode']}: expected the graphed step"
    t1, t2 = run_tensors(c1), run_tensors(c2)
    assert sorted(t1) == sorted(t2), "the two checkpoints hold different tensors"
    differ = []
    steps = [i for i, (a, b) in enumerate(zip(r1["train_loss"], r2["train_loss"])) if a != b]
    if steps:
        i = steps[0]
        differ.append(f"losses at steps {[j + 1 for j in steps]} (step {i + 1}: {r1['train_loss'][i]!r} "
                      f"vs {r2['train_loss'][i]!r})")
    tensors = [k for k in t1 if t1[k].dtype != t2[k].dtype or t1[k].shape != t2[k].shape
               or not torch.equal(bits(t1[k]), bits(t2[k]))]
    if tensors:
        differ.append(f"{len(tensors)} of {len(t1)} tensors: {', '.join(tensors[:8])}" + " ..." * (len(tensors) > 8))
    if r1["evals"] != r2["evals"]:
        differ.append(f"eval losses {r1['evals']} vs {r2['evals']}")
    assert not differ, f"two runs of {arch}, residual={residual} differ: " + "; ".join(differ)
    return (f"{arch}, {residual}: {len(r1['train_loss'])} losses (last {r1['train_loss'][-1]:.6f}), eval losses and "
            f"{len(t1)} weight and AdamW tensors bit-identical")


# The end-to-end fp32 comparisons of the op sets, set from their measured error with a margin, and tight enough
# that single-pass TF32 products fail them (mutant products_in_single_pass_tf32).
OP_SETS_LOSS_TOL = 7e-6  # train/gpu_op_sets_agree, 20 steps' losses: 7.2e-7 measured (gpt, llama; H200)
FIRST_GRADS_TOL = 1e-5   # train/gpu_first_step_grads, error over a gradient's largest entry: up to 4.7e-6 measured


def train_gpu_op_sets_agree(arch="gpt", dropout=0.0, graph_torch=False, cosine=False):
    # train.py's default config, 20 steps on each op set from the same weights and batches (train_op_set
    # seeds both from cfg.seed): torch eager, cuda graphed, as `python train.py` runs them. With dropout both
    # draw the same masks, a step's from the rng offset the step advances (the graphed one inside its graph):
    # each checkpoint's offset counts the steps. graph_torch: the torch op set graphed too (its twin's masks
    # captured, drawn on the device from the advancing offset). cosine: --lr_schedule=cosine, its lr a float32
    # device tensor that each step fills and the graphed step reads at every replay; the last one filled is
    # the last step's lr, not the first's (a float baked into the graph would part the curves).
    steps = under_tool(20, 5)
    schedule = dict(lr_schedule="cosine", warmup_iters=steps // 4, min_lr=train.DEFAULTS["lr"] / 10) if cosine else {}
    cuda = train.cuda_op_set(kernels, train.DEFAULTS["n_embd"] // train.DEFAULTS["n_head"])
    with tempfile.TemporaryDirectory() as tmp:
        trained = {ops.name: gpu_train(ops, os.path.join(tmp, ops.name), max_iters=steps, arch=arch, dropout=dropout,
                                       graph_torch=graph_torch, **schedule)
                   for ops in (train.TORCH_OPS, cuda)}
    runs = {name: r for name, (r, _) in trained.items()}
    assert runs["cuda"]["mode"] == "graph", f"cuda op set ran {runs['cuda']['mode']}"
    assert not graph_torch or runs["torch"]["mode"] == "graph", f"torch op set ran {runs['torch']['mode']}"
    if dropout:
        for name, (_, ckpt) in trained.items():
            assert ckpt["dropout_rng"].tolist() == [train.DEFAULTS["seed"], steps], \
                f"{name}: dropout's rng {ckpt['dropout_rng'].tolist()} after {steps} steps"
    t, c = (torch.tensor(runs[n]["train_loss"], dtype=torch.float64) for n in ("torch", "cuda"))
    assert len(t) == len(c) == steps, f"{len(t)} and {len(c)} losses"
    check("loss", c, t, OP_SETS_LOSS_TOL)
    if cosine:
        cfg = types.SimpleNamespace(**{**train.DEFAULTS, "max_iters": steps, **schedule})
        first, last = (torch.tensor(train.lr_at(cfg, it), dtype=torch.float32) for it in (0, steps - 1))
        assert first != last, f"lr_at gives {first} at the first step and at the last"
        for name, (_, ckpt) in trained.items():  # the optimizer's lr as its state_dict held it after the last step
            lrs = [g["lr"] for g in ckpt["optimizer"]["param_groups"]]
            assert all(torch.is_tensor(lr) and lr.shape == () and lr.dtype == torch.float32 for lr in lrs), \
                f"{name}: lr {lrs}, not a 0-dim float32 tensor"
            assert all(lr == last for lr in lrs), f"{name}: lr {lrs} after the last step, lr_at gives {last}"
    diff = (c - t).abs()
    return (f"{arch}{f', dropout {dropout}' * bool(dropout)}{', cosine lr' * cosine}: max |loss difference| "
            f"{diff.max():.2e} at step {int(diff.argmax()) + 1} of {steps} (torch {runs['torch']['mode']}, cuda "
            f"{runs['cuda']['mode']}); loss {t[0]:.4f} -> {t[-1]:.4f}")


def tf32_round(x):
    """x rounded to TF32 (10 mantissa bits, to nearest), as a single-pass TF32 tensor-core product reads it."""
    return ((x.view(torch.int32) + 0x1000) & ~0x1FFF).view(torch.float32)


@mutant("products_in_single_pass_tf32", "train/gpu_op_sets_agree", "train/gpu_op_sets_agree_llama",
        "train/gpu_first_step_grads_gpt_baseline", "train/gpu_first_step_grads_llama_baseline")
def _products_in_single_pass_tf32():
    # the cuda op set's products on TF32-rounded operands, attention in its precision='tf32'
    real = train.cuda_op_set

    def tf32_op_set(kernels, head_size, dtype="fp32"):
        ops = real(kernels, head_size, dtype)
        r = lambda t: t + (tf32_round(t) - t).detach()  # rounded forward, gradient passed as it is
        ops.linear = lambda x, w, b=None: kernels.linear(r(x), r(w), b)
        ops.matmul = lambda a, b: kernels.matmul(r(a), r(b))
        ops.attention = functools.partial(ops.attention, precision="tf32")
        return ops
    with unittest.mock.patch.object(train, "cuda_op_set", tf32_op_set):
        yield


@mutant("cuda_op_set_draws_other_masks", "train/gpu_op_sets_agree_dropout", "train/gpu_op_sets_agree_llama_dropout")
def _cuda_op_set_draws_other_masks():
    # the cuda op set's dropout sites draw their neighbour's masks (salt + 1): each mask alone is as random
    real = train.cuda_op_set

    def shifted(kernels, head_size, dtype="fp32"):
        ops = real(kernels, head_size, dtype)
        ops.dropout = lambda x, p, rng, salt=0: kernels.dropout(x, p, rng, salt + 1)
        return ops
    with unittest.mock.patch.object(train, "cuda_op_set", shifted):
        yield


@mutant("attention_dropout_ignored", "train/gpu_op_sets_agree_dropout", "attention/dropout-fp32/b2h3_q17k17_d32_causal",
        "attention/dropout-bf16/b2h3_q1000k1000_d64_causal", "attention/dropout-fp32/graph_replay")
def _attention_dropout_ignored():
    # our attention runs without its dropout (the other sites keep theirs)
    real = kernels.attention
    with unittest.mock.patch.object(kernels, "attention",
                                    lambda *a, dropout_p=0.0, rng=None, salt=0, **kw: real(*a, **kw)):
        yield


@mutant("dropout_offset_frozen", "train/gpu_op_sets_agree_dropout", "train/cpu_dropout_resume")
def _dropout_offset_frozen():
    # every training step draws the first step's masks
    with unittest.mock.patch.object(train.GPT, "next_dropout_masks", lambda self: None):
        yield


@mutant("lr_baked_into_the_graph", "train/gpu_op_sets_agree_cosine_lr")
def _lr_baked_into_the_graph():
    # the schedule's lr assigned as a float on a GPU too: the graph captures the capture step's value
    def set_float(opt, lr):
        for group in opt.param_groups:
            group["lr"] = lr
    with unittest.mock.patch.object(train, "set_lr", set_float):
        yield


def train_gpu_first_step_grads(arch, residual):
    # the loss curves of the op sets cannot see a gradient off by a constant factor (AdamW divides it out):
    # the first step's gradient of every parameter, cuda op set against torch op set, from the same weights
    head = train.DEFAULTS["n_embd"] // train.DEFAULTS["n_head"]
    cfg = types.SimpleNamespace(**{**train.DEFAULTS, "arch": arch, "residual": residual})
    x, y = (torch.randint(0, 65, (4, cfg.block_size), device=DEV) for _ in range(2))
    grads = {}
    for ops in (train.TORCH_OPS, train.cuda_op_set(kernels, head)):
        model = train.model_from_config(cfg, 65, ops).to(DEV)
        model(x, y)[1].backward()
        grads[ops.name] = {n: p.grad.double() for n, p in model.named_parameters()}
    worst = (0.0, "")
    for name, ref in grads["torch"].items():
        ours = grads["cuda"][name]
        scale = ref.abs().max().item()
        err = (ours - ref).abs().max().item() / max(scale, 1e-12)
        assert err <= FIRST_GRADS_TOL, f"{name}: gradient off by {err:.2e} of its largest entry ({scale:.2e})"
        worst = max(worst, (err, name))
    return f"{arch}, {residual}: {len(grads['torch'])} parameters; worst {worst[1]} at {worst[0]:.1e} of its largest entry"


def train_gpu_bf16_first_step_grads(arch):
    # --dtype=bf16 checked as llm.c checks its kernels: the first step's loss and every parameter's gradient
    # from the same weights, ours (bf16 kernels) and PyTorch's (autocast), each against the fp32 torch op set.
    # bf16 keeps 8 significant bits, so both land near 1e-2 of a gradient's largest entry, each rounding its
    # own way; ours must be no further from fp32 than twice PyTorch's own distance (or 1e-2, where PyTorch's
    # happens to be tiny), and the loss likewise.
    if torch.cuda.get_device_capability() != (9, 0):
        raise Skip("the cuda op set's bf16 matmul runs on Hopper's wgmma (compute capability 9.0)")
    head = train.DEFAULTS["n_embd"] // train.DEFAULTS["n_head"]
    cfg = types.SimpleNamespace(**{**train.DEFAULTS, "arch": arch})
    x, y = (torch.randint(0, 65, (4, cfg.block_size), device=DEV) for _ in range(2))
    loss, grads = {}, {}
    for name, ops in (("fp32", train.TORCH_OPS), ("torch", train.torch_op_set("bf16", DEV)),
                      ("cuda", train.cuda_op_set(kernels, head, "bf16"))):
        model = train.model_from_config(cfg, 65, ops).to(DEV)
        out = model(x, y)[1]
        out.backward()
        loss[name], grads[name] = out.item(), {n: p.grad.double() for n, p in model.named_parameters()}
    worst = (0.0, "")
    for name, ref in grads["fp32"].items():
        scale = max(ref.abs().max().item(), 1e-12)
        theirs, ours = ((grads[s][name] - ref).abs().max().item() / scale for s in ("torch", "cuda"))
        assert ours <= max(2 * theirs, 1e-2), (f"{name}: ours {ours:.2e} of its largest entry from fp32, PyTorch's "
                                                f"bf16 {theirs:.2e}")
        worst = max(worst, (ours / max(theirs, 1e-12), name))
    theirs, ours = (abs(loss[s] - loss["fp32"]) for s in ("torch", "cuda"))
    assert ours <= max(2 * theirs, 1e-3 * loss["fp32"]), f"loss: ours {ours:.2e} from fp32, PyTorch's bf16 {theirs:.2e}"
    return (f"{arch}: loss {loss['fp32']:.5f} fp32, off by {theirs:.1e} (torch bf16), {ours:.1e} (ours); worst "
            f"gradient {worst[1]}: {worst[0]:.2f}x PyTorch's bf16 distance from fp32")


class _GradTimes(torch.autograd.Function):
    """Identity forward; the gradient times 1.05 (a planted fault)."""
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * 1.05


@mutant("weight_grads_5pct_off", "train/gpu_bf16_first_step_grads_gpt", "train/gpu_first_step_grads_gpt_baseline")
def _weight_grads_5pct_off():
    real = train.cuda_op_set

    def off(kernels, head_size, dtype="fp32"):
        ops = real(kernels, head_size, dtype)
        ops.linear = lambda x, w, b=None: kernels.linear(x, _GradTimes.apply(w), b)
        return ops
    with unittest.mock.patch.object(train, "cuda_op_set", off):
        yield


def train_gpu_compiled_torch_step():
    # --compile=true: the torch op set's step through torch.compile(mode='reduce-overhead') trains like its
    # eager step (to rounding: Inductor sums in other orders), and compiling and recording the graphs fall
    # in the timing warm-up, so tokens/s counts the steps after it only.
    if UNDER_SANITIZER:  # Inductor compiling under a tool outlasts a sweep; and no kernel of ours runs here
        raise Skip("under compute-sanitizer: torch.compile of the torch op set only")
    steps = 20
    shape = dict(n_layer=2, n_head=2, n_embd=64, block_size=64, batch_size=8, max_iters=steps)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            runs = {c: gpu_train(train.TORCH_OPS, os.path.join(tmp, f"compile_{c}"), compile=c, **shape)[0]
                    for c in (False, True)}
        finally:
            torch.compiler.reset()  # the compiled step's CUDA graphs and their memory pool
    eager, comp = runs[False], runs[True]
    assert (eager["mode"], comp["mode"]) == ("eager", "compile"), f"modes {eager['mode']}, {comp['mode']}"
    warmup = max(train.DEFAULTS["timing_warmup"], train.GRAPH_WARMUP + 1)
    assert comp["timed_iters"] == steps - warmup and comp["tokens_per_s"], \
        f"{comp['timed_iters']} timed steps of {steps} ({warmup} warm-up), {comp['tokens_per_s']} tok/s"
    e, c = (torch.tensor(r["train_loss"], dtype=torch.float64) for r in (eager, comp))
    check("loss", c, e, 1e-4)
    return (f"max |loss difference| {(c - e).abs().max():.2e} over {steps} steps; tok/s eager "
            f"{eager['tokens_per_s']:,.0f}, compiled {comp['tokens_per_s']:,.0f}")


def train_gpu_compiled_cuda_step():
    # --compile=true on the cuda op set: our ops traced whole into Inductor's graph, trains like the
    # hand-captured CUDA graph of the same step, within 1e-5 over 100 steps (to rounding: Inductor fuses
    # the glue in other orders)
    if UNDER_SANITIZER:
        raise Skip("under compute-sanitizer: Inductor compiling outlasts a sweep")
    steps = 100
    shape = dict(n_layer=2, n_head=2, n_embd=64, block_size=64, batch_size=8, max_iters=steps)
    cuda = train.cuda_op_set(kernels, 32)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            runs = {c: gpu_train(cuda, os.path.join(tmp, f"compile_{c}"), compile=c, **shape)[0] for c in (False, True)}
        finally:
            torch.compiler.reset()
    graphed, comp = runs[False], runs[True]
    assert (graphed["mode"], comp["mode"]) == ("graph", "compile"), f"modes {graphed['mode']}, {comp['mode']}"
    g, c = (torch.tensor(r["train_loss"], dtype=torch.float64) for r in (graphed, comp))
    check("loss", c, g, 1e-5)
    return (f"max |loss difference| {(c - g).abs().max():.2e} over {steps} steps; tok/s graphed "
            f"{graphed['tokens_per_s']:,.0f}, compiled {comp['tokens_per_s']:,.0f}")


def train_gpu_cuda_model_fullgraph(arch, residual, dtype):
    # the GPT on the cuda op set compiles with fullgraph=True (no graph break) and its loss and gradients
    # match the eager model's
    import torch._dynamo
    if UNDER_SANITIZER:
        raise Skip("under compute-sanitizer: Inductor compiling outlasts a sweep")
    ops = train.cuda_op_set(kernels, 32, dtype)
    model = train.GPT(65, 32, 64, 2, 2, 0, ops, residual=residual, arch=arch).to(DEV)
    x, y = (torch.randint(0, 65, (4, 32), device=DEV) for _ in range(2))
    explain = torch._dynamo.explain(model)(x, y)
    assert explain.graph_break_count == 0, f"{explain.graph_break_count} graph breaks: {explain.break_reasons}"
    torch._dynamo.reset()
    losses, grads = [], []
    for m in (model, torch.compile(model, fullgraph=True)):
        model.zero_grad(set_to_none=True)
        loss = m(x, y)[1]
        loss.backward()
        losses.append(loss.detach().double())
        grads.append([p.grad.detach().double().clone() for p in model.parameters()])
    tol = 1e-5 if dtype == "fp32" else 1e-2
    check("loss", losses[1], losses[0], (tol, tol))
    worst = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item() for a, b in zip(grads[1], grads[0]))
    assert worst <= tol, f"a parameter's gradient differs by {worst:.2e} of its largest entry"
    return f"{explain.graph_count} graph(s), 0 breaks; gradients within {worst:.1e} (relative)"


def train_gpu_bf16_op_sets_close(arch="gpt", residual="baseline", dropout=0.0):
    # --dtype=bf16: the torch op set under autocast and ours on the bf16 kernels, 100 steps each from the
    # same weights and batches. bf16 rounds differently in each (cuBLAS's and our accumulation orders), so
    # the curves drift apart; how far is what this reports, and it must stay at bf16's scale
    if torch.cuda.get_device_capability() != (9, 0):
        raise Skip("the cuda op set's bf16 matmul runs on Hopper's wgmma (compute capability 9.0)")
    steps = under_tool(100, 10)
    head = train.DEFAULTS["n_embd"] // train.DEFAULTS["n_head"]
    with tempfile.TemporaryDirectory() as tmp:
        runs = {ops.name: gpu_train(ops, os.path.join(tmp, ops.name), max_iters=steps, arch=arch, dtype="bf16",
                                    residual=residual, dropout=dropout)[0]
                for ops in (train.torch_op_set("bf16", DEV), train.cuda_op_set(kernels, head, "bf16"))}
    t, c = (torch.tensor(runs[n]["train_loss"], dtype=torch.float64) for n in ("torch", "cuda"))
    diff = (c - t).abs()
    check("loss", c, t, (0.0, 0.02))  # within 2% of the torch op set's loss at every step
    vt, vc = runs["torch"]["final_val_loss"], runs["cuda"]["final_val_loss"]
    check("val_loss", torch.tensor(vc), torch.tensor(vt), (0.0, 0.01))
    return (f"{arch} {residual} bf16{f' dropout {dropout}' * bool(dropout)}: max |loss difference| {diff.max():.2e} at step {int(diff.argmax()) + 1} of {steps}; loss "
            f"{t[0]:.4f} -> {t[-1]:.4f}; val torch {vt:.4f}, cuda {vc:.4f}")


def train_gpu_ddp_two_gpus():
    # torchrun on 2 GPUs, both op sets (torch eager, cuda graphed after DDP's 11 eager steps), batch 8 a
    # rank: the op sets agree as on one GPU, and the cuda op set's losses match one GPU at batch 16
    if torch.cuda.device_count() < 2:
        raise Skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    if UNDER_SANITIZER:
        raise Skip("under compute-sanitizer: torchrun's ranks would run outside the tool")
    steps = 30
    with tempfile.TemporaryDirectory() as tmp:
        text = os.path.join(tmp, "text.txt")
        with open(text, "w") as f:
            f.write(gpu_train_text())
        common = [f"--data_path={text}", f"--max_iters={steps}", "--eval_interval=30", "--eval_iters=2",
                  "--sample_len=0", "--plot=false"]
        two = _torchrun(*common, f"--out_dir={tmp}/two", "--batch_size=8")
        _train_check_ok(two, "torchrun on 2 GPUs")
        one = _train_run(*common, f"--out_dir={tmp}/one", "--batch_size=16", "--backend=cuda")
        _train_check_ok(one, "one GPU, batch 16")
        loss = {name: torch.tensor(_train_load_ckpt(f"{tmp}/{name}")["train_loss"], dtype=torch.float64)
                for name in ("two/ckpt_torch.pt", "two/ckpt_cuda.pt", "one/ckpt_cuda.pt")}
    check("op_sets", loss["two/ckpt_cuda.pt"], loss["two/ckpt_torch.pt"], 1e-4)
    check("one_gpu", loss["two/ckpt_cuda.pt"], loss["one/ckpt_cuda.pt"], 1e-4)
    speed = re.findall(r"^(torch|cuda)\s+(\w+)\s+.*?([\d,]+)$", two.stdout, re.M)
    return f"{steps} steps; tok/s of 2 ranks: " + ", ".join(f"{n} {m} {t}" for n, m, t in speed)


add("train/gpu_ddp_two_gpus", train_gpu_ddp_two_gpus)
add("train/gpu_deterministic_baseline", train_gpu_deterministic, "baseline")
add("train/gpu_deterministic_mhc", train_gpu_deterministic, "mhc")
add("train/gpu_deterministic_llama", train_gpu_deterministic, "baseline", arch="llama")
add("train/gpu_op_sets_agree", train_gpu_op_sets_agree)
add("train/gpu_op_sets_agree_llama", train_gpu_op_sets_agree, "llama")
add("train/gpu_op_sets_agree_dropout", train_gpu_op_sets_agree, dropout=0.2)
add("train/gpu_op_sets_agree_llama_dropout", train_gpu_op_sets_agree, "llama", dropout=0.2)
add("train/gpu_op_sets_agree_dropout_graph_torch", train_gpu_op_sets_agree, dropout=0.2, graph_torch=True)
add("train/gpu_op_sets_agree_cosine_lr", train_gpu_op_sets_agree, cosine=True)
add("train/gpu_bf16_op_sets_close", train_gpu_bf16_op_sets_close)
add("train/gpu_bf16_first_step_grads_gpt", train_gpu_bf16_first_step_grads, "gpt")
add("train/gpu_bf16_first_step_grads_llama", train_gpu_bf16_first_step_grads, "llama")
add("train/gpu_bf16_op_sets_close_llama", train_gpu_bf16_op_sets_close, "llama")
add("train/gpu_bf16_op_sets_close_mhc", train_gpu_bf16_op_sets_close, "gpt", "mhc")
add("train/gpu_bf16_op_sets_close_mhc-dynamic", train_gpu_bf16_op_sets_close, "gpt", "mhc-dynamic")
add("train/gpu_bf16_op_sets_close_dropout", train_gpu_bf16_op_sets_close, dropout=0.2)
add("train/gpu_compiled_torch_step", train_gpu_compiled_torch_step)
add("train/gpu_compiled_cuda_step", train_gpu_compiled_cuda_step)
add("inference/gpu_patched_compiled_gpt", inference_gpu_patched_compiled_gpt)
add("inference/gpu_patched_calls", inference_gpu_patched_calls)
add("inference/gpu_patched_cross_entropy_bad_target", inference_gpu_patched_cross_entropy_bad_target)
add("inference/gpu_patched_dropout", inference_gpu_patched_dropout)
add("readme/patched_example", readme_patched_example)
for _arch, _res, _dt in (("gpt", "baseline", "fp32"), ("llama", "baseline", "fp32"), ("gpt", "mhc", "fp32"),
                         ("gpt", "mhc-dynamic", "fp32"), ("gpt", "baseline", "bf16"), ("llama", "baseline", "bf16"),
                         ("gpt", "mhc", "bf16"), ("gpt", "mhc-dynamic", "bf16")):
    add(f"train/gpu_cuda_model_fullgraph_{_arch}_{_res}_{_dt}", train_gpu_cuda_model_fullgraph, _arch, _res, _dt)
for _arch, _res in (("gpt", "baseline"), ("llama", "baseline"), ("gpt", "mhc-dynamic")):
    add(f"train/gpu_first_step_grads_{_arch}_{_res}", train_gpu_first_step_grads, _arch, _res)


# ==== the sources' layout (CPU) ====
# kernels.cu reads top to bottom in numbered sections; its table of contents gives the line each starts
# on. Each limit is stated once, in kernels.cu's part 0; and the README's "Adding an op" counts the edits
# a new op takes, checked against one that exists (swiglu).

TOC_START = "// Contents: section, the line it starts on"


def kernels_sections(lines):
    """(number, title, line) of each section of kernels.cu: a '// N. Title' line under a '// ====' rule
    (a layer) or a '// N.M title' line under a '// ----' rule (a section in it); lines count from 1."""
    for i in range(1, len(lines)):
        m = re.fullmatch(r"// (\d+)\. (.+)", lines[i]) if lines[i - 1].startswith("// ====") else \
            re.fullmatch(r"// (\d+\.\d+) (.+)", lines[i]) if lines[i - 1].startswith("// ----") else None
        if m:
            yield m.group(1), m.group(2), i + 1


def toc_entries(lines):
    """The table of contents as written: [(number, title, line)], and where it sits (first, end)."""
    first = next(i for i, line in enumerate(lines) if line.startswith(TOC_START)) + 1
    end = first
    while end < len(lines) and re.match(r"//\s+\d", lines[end]):
        end += 1
    entries = []
    for line in lines[first:end]:
        m = re.fullmatch(r"//\s+(\d+(?:\.\d+)?)\s+(.+?) \.+ (\d+)", line)
        entries.append((m.group(1), m.group(2), int(m.group(3))) if m else (None, line, None))
    return entries, first, end


def toc_line(number, title, line):
    head = f"//   {number:<5}{title} "
    return head + "." * max(3, 100 - len(head) - len(str(line)) - 1) + f" {line}"


def renumbered_toc(text):
    """kernels.cu's text with its table of contents rewritten from its sections (the TOC's own length is
    that of the section list, so one pass puts every line number right)."""
    lines = text.split("\n")
    _, first, end = toc_entries(lines)
    sections = list(kernels_sections(lines))
    shift = len(sections) - (end - first)
    lines[first:end] = [toc_line(n, t, line + shift) for n, t, line in sections]
    return "\n".join(lines)


def source_text(name):
    """A file of the repo as text (the layout's mutants plant their faults here)."""
    with open(os.path.join(HERE, name)) as f:
        return f.read()


def write_toc():
    path = os.path.join(HERE, "kernels.cu")
    text = source_text("kernels.cu")
    new = renumbered_toc(text)
    if new != text:
        data.atomic_write(path, lambda f: f.write(new.encode()))
    sections = len(list(kernels_sections(new.split("\n"))))
    state = "rewritten" if new != text else "already up to date"
    print(f"kernels.cu: {sections} sections; table of contents {state}")
    return 0


def kernels_table_of_contents():
    lines = source_text("kernels.cu").split("\n")
    entries, _, _ = toc_entries(lines)
    sections = list(kernels_sections(lines))
    if entries != sections:
        stale = [f"{w} (file: {s})" for w, s in itertools.zip_longest(entries, sections) if w != s]
        raise AssertionError(f"kernels.cu's table of contents is stale at {stale[:3]}: run python test_ops.py --toc")
    CHECKS.append(f"{len(sections)} sections, each at the line its entry gives")


add("kernels/table_of_contents", kernels_table_of_contents, gpu=False)


# Each limit's value where a source, a message or the README would restate it for that limit (the words
# around the number say which). kernels.cu's part 0 states them; everything else reads kernels.LIMITS or
# limits::<name>.
LIMIT_RESTATED = {
    "max_streams": r"(?:\b|_)n\s*<=?\s*8\b|\b8\s+streams|streams?\D{0,24}\b(?:up to|at most|<=)\s*8\b|n up to 8",
    "topk_max_k": r"(?:\b|_)k\s*<=?\s*128\b|top-?k\D{0,30}\b(?:at most|up to|<=)\s*128\b|min\(128",
    "megakernel_max_experts": r"\b64\s+(?:rows \()?experts|experts\D{0,16}\b(?:at most|<=|>)\s*64\b|\bE\s*<=\s*64\b",
    "megakernel_max_top_k": r"takes at most 2\b|top_k\s*(?:<=|>)\s*2\b|1 or 2\b",
    "megakernel_max_layers": r"\b64\s+layers|layers\D{0,12}\b(?:at most|<=)\s*64\b|\[1, 64\]",
    "fused_head_sizes": r"\b32, 64, 96,? (?:and )?128\b",
    "megakernel_layer_weights": r"\"ln_1_w\",\s*\"ln_1_b\"",
}
LIMIT_FILES = ("kernels.cu", "bindings.cpp", "train.py", "inference.py", "mhc.py", "data.py", "test_ops.py",
               "README.md")
LAYOUT_SECTION = "# ==== the sources' layout (CPU) ===="  # its patterns and planted faults state the limits


def limits_of_kernels_cu(text):
    """The names and values of kernels.cu's namespace limits (part 0), as text."""
    block = text[text.index("namespace limits {"):text.index("}  // namespace limits")]
    return dict(re.findall(r"(?:constexpr [\w\s\*]+?|using )(\w+)(?:\[\])? = ([^;]+);", block))


def limit_restatements(texts):
    """(file, line number, limit, line) of each place a limit is restated outside kernels.cu's part 0."""
    found = []
    for name, text in texts.items():
        lines = text.split("\n")
        skip = range(0)
        if name == "kernels.cu":  # part 0 states them
            skip = range(lines.index("namespace limits {"), lines.index("}  // namespace limits") + 1)
        if name == "test_ops.py":
            first = lines.index(LAYOUT_SECTION)
            skip = range(first, next(i for i in range(first + 1, len(lines)) if lines[i].startswith("# ==== ")))
        for i, line in enumerate(lines):
            for limit, pattern in LIMIT_RESTATED.items():
                if i not in skip and re.search(pattern, line):
                    found.append((name, i + 1, limit, line.strip()))
    return found


def kernels_limits_stated_once():
    texts = {f: source_text(f) for f in LIMIT_FILES}
    stated = limits_of_kernels_cu(texts["kernels.cu"])
    missing = sorted(set(LIMIT_RESTATED) - set(stated))
    assert not missing, f"kernels.cu's namespace limits lacks {missing}"
    again = limit_restatements(texts)
    assert not again, "limits restated outside kernels.cu's part 0 (read kernels.LIMITS or limits::<name>):\n" + \
        "\n".join(f"  {f}:{n} ({limit}): {line}" for f, n, limit, line in again)
    CHECKS.append(f"{len(stated)} limits in kernels.cu's part 0, none restated in {len(LIMIT_FILES)} files")


add("kernels/limits_stated_once", kernels_limits_stated_once, gpu=False)


@mutant("toc_line_stale", "kernels/table_of_contents")
def _toc_line_stale():
    real = source_text
    with unittest.mock.patch(__name__ + ".source_text",
                             lambda name: real(name).replace("\n", "\n\n", 1) if name == "kernels.cu" else real(name)):
        yield  # every section one line further down than its entry says


@mutant("limit_restated", "kernels/limits_stated_once")
def _limit_restated():
    real = source_text
    with unittest.mock.patch(__name__ + ".source_text", lambda name: real(name) + (
            "\n    if not 0 <= cfg.sample_top_k <= 128:\n" if name == "inference.py" else "")):
        yield


# What adding an op takes, counted on one that exists: the places of each file that hold its material.
ADDING_AN_OP_EXAMPLE = "swiglu"


def op_edits(op, texts):
    """[(file, place)]: where op's own material sits. kernels.cu: part 0's declarations and each numbered
    section that defines a launch::<op>_ launcher; bindings.cpp: each '// ---- ' section that names the op's
    schema or functions; train.py: its twin in TORCH_OPS; test_ops.py: each '# ==== ' block that registers
    its cases, bad inputs, opcheck arguments or bench rows; README.md: its row in the ops table."""
    places = []

    def sections(text, starts):
        name, out = "(top)", collections.defaultdict(list)
        for line in text.split("\n"):
            m = re.match(starts, line)
            name = m.group(1) if m else name
            out[name].append(line)
        return {k: "\n".join(v) for k, v in out.items()}
    kcu = texts["kernels.cu"]
    launch = kcu[kcu.index("namespace launch {"):kcu.index("}  // namespace launch")]
    places += [("kernels.cu", "0 (declarations)")] * bool(re.search(rf"\b{op}_\w*\(", launch))
    lines = kcu.split("\n")
    numbered = [(n, line) for n, _, line in kernels_sections(lines) if "." in n]
    for (n, start), (_, end) in zip(numbered, numbered[1:] + [(None, len(lines) + 1)]):
        if re.search(rf"launch::{op}_\w+\(", "\n".join(lines[start - 1:end - 1])):
            places.append(("kernels.cu", n))
    for name, text in sections(texts["bindings.cpp"], r"// ---- (.+?) -+$").items():
        if re.search(rf'"{op}[(_"]|\b{op}_(?:cuda|meta|autograd|autocast)\b', text):
            places.append(("bindings.cpp", name))
    places += [("train.py", "TORCH_OPS")] * len(re.findall(rf"^\s+{op}=", texts["train.py"], re.M))
    own = (rf'add\("(?:empty/)?{op}[/_]|\("{op}_\w+", \w+Error|\("{op}(?:_backward)?", k(?:ernels)?\.'
           rf'|bench_op\(rows, "{op}')
    for name, text in sections(texts["test_ops.py"], r"# ==== (.+) ====$").items():
        if re.search(own, text):
            places.append(("test_ops.py", name))
    places += [("README.md", "the ops table")] * len(re.findall(rf"^\| `{op}\(", texts["README.md"], re.M))
    return places


def readme_adding_an_op():
    texts = {f: source_text(f) for f in ("kernels.cu", "bindings.cpp", "train.py", "test_ops.py", "README.md")}
    places = op_edits(ADDING_AN_OP_EXAMPLE, texts)
    m = re.search(r"## Adding an op\n\n.*?\b(\w+) edits, as `(\w+)`", texts["README.md"], re.S)
    assert m and m.group(2) == ADDING_AN_OP_EXAMPLE, "README's 'Adding an op' does not state its count for " + \
        ADDING_AN_OP_EXAMPLE
    words = {"four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8}
    stated = words.get(m.group(1).lower(), m.group(1))
    assert stated == len(places), \
        f"README says {m.group(1)} edits; {ADDING_AN_OP_EXAMPLE} takes {len(places)}: {places}"
    CHECKS.append(f"{ADDING_AN_OP_EXAMPLE}: {len(places)} edits, as the README says: " +
                  ", ".join(f"{f} {p}" for f, p in places))


add("readme/adding_an_op", readme_adding_an_op, gpu=False)


@mutant("op_material_scattered", "readme/adding_an_op")
def _op_material_scattered():
    real = source_text
    stray = f'\nadd("{ADDING_AN_OP_EXAMPLE}/stray", t_swiglu, (3,))\n'  # a case registered in the runner's section
    with unittest.mock.patch(__name__ + ".source_text", lambda name: real(name).replace(
            "# ==== mutants ====\n", "# ==== mutants ====\n" + stray, 1) if name == "test_ops.py" else real(name)):
        yield


def readme_reading_path():
    """The README's reading path names sections kernels.cu has and --only values that pick cases (and, after
    --bench, a bench table or an op's rows)."""
    readme = source_text("README.md")
    section = readme[readme.index("## Reading path"):readme.index("\n## ", readme.index("## Reading path") + 3)]
    stops = re.findall(r"^\| \d\. .*$", section, re.M)
    path = "\n".join(stops)
    assert 5 <= len(stops) <= 8, f"{len(stops)} stops"
    numbers = {n for n, _, _ in kernels_sections(source_text("kernels.cu").split("\n"))}
    named = set(re.findall(r"\b(\d\.\d)\b", path)) | {f"{a}.{i}" for a, b, c in re.findall(
        r"\b(\d)\.(\d)-\d\.(\d)\b", path) for i in range(int(b), int(c) + 1)}
    assert named <= numbers, f"sections the README names that kernels.cu lacks: {sorted(named - numbers)}"
    cases = [n for n, _, _ in CASES]
    for only in re.findall(r"(?<!bench )--only ([\w-]+)", path):
        assert any(only in n for n in cases), f"--only {only} picks no case"
    bench_names = set(BENCH_TABLES) | set(
        re.findall(r'bench_(?:op|bf16_rows)\(rows, f?"([^"{]+)', source_text("test_ops.py")))
    for only in re.findall(r"--bench --only ([\w-]+)", path):
        assert any(only in n for n in bench_names), f"--bench --only {only} picks no bench row"
    CHECKS.append(f"{len(stops)} stops; sections {', '.join(sorted(named))} are kernels.cu's; every --only picks cases")


add("readme/reading_path", readme_reading_path, gpu=False)


@mutant("reading_path_stale", "readme/reading_path")
def _reading_path_stale():
    real = source_text
    with unittest.mock.patch(__name__ + ".source_text", lambda name: real(name).replace(
            "| 9.1 the megakernel |", "| 9.9 the megakernel |") if name == "README.md" else real(name)):
        yield  # a stop naming a section kernels.cu does not have


# ==== main ====


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", metavar="SUBSTR",
                        help="run the cases (or bench ops) whose name contains this")
    parser.add_argument("--bench", action="store_true", help="time every op against PyTorch instead of testing")
    parser.add_argument("--mutants", action="store_true",
                        help="plant each known fault and check that the cases which guard against it fail")
    parser.add_argument("--json", metavar="PATH", help="with --bench: also write the rows as a JSON list")
    parser.add_argument("--gpu_only", action="store_true", help="run only the GPU cases (as under compute-sanitizer)")
    parser.add_argument("--shard", default="0/1", metavar="K/N",
                        help="run cases K, K+N, K+2N, ... of those selected (parallel sanitizer runs)")
    parser.add_argument("--sanitize", nargs="?", const=",".join(SANITIZER_TOOLS), metavar="TOOLS",
                        help="run the GPU cases under compute-sanitizer's tools (comma-separated; default all "
                             "four), --shards processes a tool in parallel, and summarise the reports")
    parser.add_argument("--shards", type=int, default=4, help="with --sanitize: processes per tool")
    parser.add_argument("--log_dir", default="out/sanitize", help="with --sanitize: where the logs go")
    parser.add_argument("--skip_file", metavar="PATH", help="don't run the cases named in this file, one a line "
                        "(--sanitize uses it to resume)")
    parser.add_argument("--toc", action="store_true",
                        help="rewrite kernels.cu's table of contents from its sections (after adding or moving one)")
    parser.add_argument("--filter", choices=("ours", "none"), default="ours",
                        help="with --sanitize: instrument only kernels.cu's kernels where the tool allows (ours) "
                             "or every kernel (none)")
    args = parser.parse_args()
    if args.json and not args.bench:
        parser.error("--json goes with --bench")
    try:
        shard = tuple(int(v) for v in args.shard.split("/"))
        assert len(shard) == 2 and 0 <= shard[0] < shard[1]
    except (ValueError, AssertionError):
        parser.error(f"--shard must be K/N with 0 <= K < N, got {args.shard!r}")
    ONLY = args.only
    skip = frozenset(open(args.skip_file).read().split()) if args.skip_file else frozenset()
    if args.sanitize:
        tools = args.sanitize.split(",")
        if bad := [t for t in tools if t not in SANITIZER_TOOLS]:
            parser.error(f"--sanitize: unknown tool(s) {bad}; the tools are {', '.join(SANITIZER_TOOLS)}")
        if args.shards < 1:
            parser.error(f"--shards must be >= 1, got {args.shards}")
        if not shutil.which("compute-sanitizer"):
            parser.error("--sanitize needs compute-sanitizer (CUDA toolkit) on the PATH")
        sys.exit(sanitize(tools, args.shards, args.only, args.log_dir, args.filter == "ours"))
    if args.mutants:
        sys.exit(run_mutants(args.only))
    if args.toc:
        sys.exit(write_toc())
    sys.exit(bench_main(args.json) if args.bench else run_tests(args.only, args.gpu_only, shard, skip))
