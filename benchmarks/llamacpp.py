"""llama.cpp as a peer on the same machine (issue 28 item 5): stage, build, convert, pick --n-cpu-moe, run, report.

llama.cpp keeps the routed experts of its first N layers in host memory and computes them on the CPU
(`--n-cpu-moe N`); everything else sits on the GPU (`-ngl 99`). This script runs it on the checkpoints the bench
uses, greedy, on the bench's prompts, with N chosen so that its GPU memory fits the same budget Specter gets, and
reads its TPOT from llama.cpp's own timing lines.

Subcommands (each prints what it did; `python benchmarks/llamacpp.py SUB --help`):

    stage    trim llama.cpp out of the llama-cpp-python sdist into a git-ignored tree (default ./.llama.cpp), which
             travels to the GPU machine like .whl (carry it)
    build    cmake + ninja of only llama-completion and llama-bench (CUDA with --cuda), timed; a no-op when built
    convert  a Hugging Face checkpoint dir -> GGUF with llama.cpp's own convert_hf_to_gguf.py (see BYTE TOKENIZER);
             --spill DIR writes it split across two file systems (`convert`)
    drop     delete a GGUF convert wrote, its shards and their spilled files
    plan     N for --n-cpu-moe from the GGUF's tensor bytes and a GPU budget
    run      llama-completion greedy on the checkpoint's prompts (+ llama-bench): raw logs and summary.json
    all      build, convert, plan and run: the GPU flow in one call (benchmarks/reproduce.sh llamacpp)

BYTE TOKENIZER. The bench's checkpoints carry a byte-level BPE with 256 tokens and no merges (id = byte value,
benchmarks/reference_model.py `save_tokenizer`). llama.cpp's converter identifies a BPE pre-tokenizer by hashing its
encoding of a fixed text and refuses unknown hashes; and llama.cpp refuses a BPE vocabulary without merges, while
gguf-py silently drops an empty merge list. `convert` therefore runs the converter unchanged in-process with two
run-time additions, both only for a tokenizer that maps every text to its UTF-8 bytes: (1) the pre-tokenizer is
declared "gpt-2" (for a vocabulary of single bytes without merges every pre-tokenizer split gives the same ids, so
the choice cannot change a token); (2) one inert merge is written (`INERT_MERGE`: two strings that are not tokens,
so no symbol pair ever matches it). With `--spill`, one more, which changes where the bytes go and not one of them:
the writer's shard names become links into the spill directory for the shards that do not fit (`spill_shards`). No
file of llama.cpp is edited. `run` checks that llama.cpp tokenizes each
prompt to exactly the prompt's ids (`--verbose-prompt`), and reads the generated ids back as bytes of its output.
"""

from __future__ import annotations

import argparse
import atexit
import fnmatch
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TREE = REPO / ".llama.cpp"
TARGETS = ("llama-completion", "llama-bench")
GiB, MiB = 1 << 30, 1 << 20
DEADLINE: float | None = None
"""time.monotonic() by which `run` / `all` must be done (--deadline-s): children are stopped there, not orphaned."""


def time_left(at_most: float = 600.0) -> float:
    """Seconds a child may take: `at_most`, or less before the deadline (at least 1)."""
    return at_most if DEADLINE is None else max(1.0, min(at_most, DEADLINE - time.monotonic()))


# ---- stage ---------------------------------------------------------------------------------------------------
# What a build of TARGETS (CPU and CUDA backends only) and the converter need from vendor/llama.cpp. The tools/
# folders kept are those tools/CMakeLists.txt adds with LLAMA_BUILD_SERVER=OFF and GGML_RPC=OFF (CMake wants every
# added folder's sources even when only two targets are built); examples, tests, pocs and app are switched off.
KEEP_TOP = ("CMakeLists.txt", "LICENSE", "cmake", "include", "src", "common", "vendor", "ggml", "tools", "licenses",
            "gguf-py", "conversion", "convert_hf_to_gguf.py")
DROP = ("ggml/src/ggml-blas", "ggml/src/ggml-cann", "ggml/src/ggml-et", "ggml/src/ggml-hexagon", "ggml/src/ggml-hip",
        "ggml/src/ggml-metal", "ggml/src/ggml-musa", "ggml/src/ggml-opencl", "ggml/src/ggml-openvino", "ggml/src/ggml-rpc",
        "ggml/src/ggml-sycl", "ggml/src/ggml-virtgpu", "ggml/src/ggml-vulkan", "ggml/src/ggml-webgpu", "ggml/src/ggml-zdnn",
        "ggml/src/ggml-zendnn", "tools/ui", "tools/server", "tools/cli", "tools/rpc", "tools/tuning", "gguf-py/tests",
        "gguf-py/examples", "docs", "media")
DROP_PATTERNS = ("*.png", "*.jpg", "*.gif", "*.mp4", "*.wav", "*.gguf", "__pycache__", ".github", ".devops")


def stage(sdist: Path, dest: Path) -> dict[str, Any]:
    """Unpack `sdist`'s vendor/llama.cpp, keep what the build and the converter need, write it to `dest`."""
    with tarfile.open(sdist) as archive:
        top = archive.getmembers()[0].name.split("/")[0]  # llama_cpp_python-X.Y.Z; the submodule's HEAD is its commit
        prefix = f"{top}/vendor/llama.cpp"
        members = [m for m in archive.getmembers() if _kept(m.name, prefix) and (m.isfile() or m.isdir())]
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        for member in members:
            member.name = member.name[len(prefix) + 1 :]
            archive.extract(member, dest, filter="data")
        head = archive.extractfile(f"{top}/.git/modules/vendor/llama.cpp/HEAD")
        commit = head.read().decode().strip() if head else "unknown"
    record = {"sdist": sdist.name, "llama_cpp_commit": commit, "kept": KEEP_TOP, "dropped": DROP}
    (dest / "STAGED.json").write_text(json.dumps(record, indent=1) + "\n")
    return {"dest": str(dest), "files": sum(1 for p in dest.rglob("*") if p.is_file()), "bytes": _tree_bytes(dest)}


def _kept(name: str, prefix: str) -> bool:
    if not name.startswith(prefix + "/"):
        return False
    rel = name[len(prefix) + 1 :]
    parts = rel.split("/")
    if parts[0] not in KEEP_TOP or any(rel == d or rel.startswith(d + "/") for d in DROP):
        return False
    return not any(fnmatch.fnmatch(part, pattern) for part in parts for pattern in DROP_PATTERNS)


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def ignore_tree(dest: Path) -> None:
    """Keep the staged tree out of git (like stage-wheels.sh does for .whl): it travels as a carried path."""
    top = subprocess.run(["git", "-C", str(dest.parent), "rev-parse", "--git-common-dir"], capture_output=True, text=True)
    if top.returncode != 0:
        return
    exclude = Path(dest.parent, top.stdout.strip(), "info", "exclude")
    line = f"/{dest.name}/"
    if line not in (exclude.read_text().split() if exclude.is_file() else []):
        exclude.parent.mkdir(parents=True, exist_ok=True)
        with exclude.open("a") as handle:
            handle.write(line + "\n")


# ---- build ------------------------------------------------------------------------------------------------------
def cmake_args(tree: Path, build_dir: Path, cuda: bool, commit: str, flash_attn: bool = True) -> list[str]:
    """Configure only what TARGETS need: no tests, examples, server, app, network (curl, openssl) or other backends.
    flash_attn=False: the CUDA flash-attention kernels compile empty (GGML_CUDA_FA=OFF; attention then runs without
    them), about a quarter less CUDA compile time (measured per file: 6.5 instead of about 30 CPU-seconds)."""
    args = ["cmake", "-S", str(tree), "-B", str(build_dir), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
            "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DGGML_CCACHE=OFF",
            f"-DLLAMA_BUILD_COMMIT={commit}"]
    if cuda:
        args += ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90", *cuda_library_args()]
        args += [] if flash_attn else ["-DGGML_CUDA_FA=OFF"]
    return args


def cuda_library_args() -> list[str]:
    """Where cuBLAS and the driver library are, when the toolkit's own folders lack them.

    The machines' toolkits are assembled from NVIDIA's pip wheels: /usr/local/cuda may hold nvcc and cudart but not
    cuBLAS, which then sits in site-packages/nvidia/cu13 (PyTorch's dependency) as libcublas.so.13 with no
    unversioned name that CMake's FindCUDAToolkit would look for; and libcuda.so.1 comes with the driver, without
    the toolkit's stub. So: name the libraries to CMake outright and add the include folder."""
    args: list[str] = []
    toolkit = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    if not any(toolkit.glob("lib*/libcublas.so*")) and not any(toolkit.glob("targets/*/lib/libcublas.so*")):
        found = _pip_cublas()
        if found is not None:
            lib, include = found
            args += [f"-DCUDA_cublas_LIBRARY={next(lib.glob('libcublas.so*'))}",
                     f"-DCUDA_cublasLt_LIBRARY={next(lib.glob('libcublasLt.so*'))}",
                     f"-DCMAKE_CUDA_FLAGS=-I{include}", f"-DCMAKE_CXX_FLAGS=-I{include}",
                     f"-DCMAKE_EXE_LINKER_FLAGS=-Wl,-rpath,{lib}"]
    if not any(toolkit.glob("lib*/libcuda.so")) and not any(toolkit.glob("lib*/stubs/libcuda.so")):
        driver = _driver_library()
        args += [f"-DCUDA_cuda_driver_LIBRARY={driver}"] if driver else ["-DGGML_CUDA_NO_VMM=ON"]
    return args


def _pip_cublas() -> tuple[Path, Path] | None:
    """(lib, include) of the nvidia-cublas wheel of the Python running this, if installed."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    for root in [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []:
        for lib in sorted(root.glob("*/lib")) + [root / "cublas" / "lib"]:
            if any(lib.glob("libcublas.so*")) and (lib.parent / "include" / "cublas_v2.h").is_file():
                return lib, lib.parent / "include"
    return None


def _driver_library() -> str | None:
    """libcuda.so.1 (the driver's) as the dynamic loader knows it, else in the usual folders."""
    listed = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout if shutil.which("ldconfig") else ""
    for line in listed.splitlines():
        if "libcuda.so.1 " in line and "x86-64" in line:
            return line.rsplit("=>", 1)[1].strip()
    for folder in ("/usr/lib/x86_64-linux-gnu", "/usr/local/nvidia/lib64", "/usr/lib64", "/usr/local/cuda/compat"):
        if Path(folder, "libcuda.so.1").exists():
            return str(Path(folder, "libcuda.so.1"))
    return None


def build(tree: Path, build_dir: Path, cuda: bool, jobs: int | None, log: Path | None = None,
          flash_attn: bool = True) -> dict[str, Any]:
    """Configure (once) and build TARGETS with ninja; timed. Ninja skips the build when nothing changed."""
    commit = staged_version(tree).get("llama_cpp_commit", "unknown")
    lines: list[str] = []
    record: dict[str, Any] = {"tree": str(tree), "build_dir": str(build_dir), "cuda": cuda, "jobs": jobs or os.cpu_count(),
                              "flash_attn_kernels": flash_attn, "llama_cpp_commit": commit}
    started = time.monotonic()
    if not (build_dir / "build.ninja").is_file():
        configure = subprocess.run(cmake_args(tree, build_dir, cuda, commit, flash_attn), capture_output=True, text=True)
        lines += [configure.stdout, configure.stderr]
        record["configure_s"] = round(time.monotonic() - started, 1)
        if configure.returncode != 0:
            record |= {"rc": configure.returncode, "error": _last_error(configure.stdout + configure.stderr)}
            _write(log, lines)
            return record
    compiled = time.monotonic()
    try:
        make = subprocess.run(["ninja", "-C", str(build_dir), *(["-j", str(jobs)] if jobs else []), *TARGETS],
                              capture_output=True, text=True, timeout=time_left(3600))
    except subprocess.TimeoutExpired as stopped:
        make = subprocess.CompletedProcess(stopped.cmd, 124, _text(stopped.stdout), _text(stopped.stderr)
                                           + "\nstopped at the deadline: a next build goes on from the objects built\n")
    lines += [make.stdout, make.stderr]
    record |= {"rc": make.returncode, "build_s": round(time.monotonic() - compiled, 1),
               "total_s": round(time.monotonic() - started, 1),
               "steps": len(re.findall(r"^\[\d+/\d+\]", make.stdout, re.M))}
    if make.returncode != 0:
        record["error"] = _last_error(make.stdout + make.stderr)
    _write(log, lines)
    return record


def _text(value: bytes | str | None) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value or ""


def _write(path: Path | None, parts: Iterable[str]) -> None:
    """Append (a build resumed or repeated adds to its log)."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as handle:
            handle.write("\n".join(parts) + "\n")


# ---- convert ---------------------------------------------------------------------------------------------------
BYTE_PRE = "gpt-2"
"""The pre-tokenizer declared for a byte tokenizer: any would do (single-byte tokens, no merges); gpt-2 is the plainest."""
INERT_MERGE = "ĠĠ ĠĠ"
"""The one merge written for a byte tokenizer: llama.cpp needs a merge list and gguf-py drops an empty one. Its two
sides are "ĠĠ" (two byte symbols), which is no token and which no other merge forms, so it never applies."""
ARCH_ALIASES = {"PhimoeForCausalLM": "PhiMoEForCausalLM"}
"""transformers' native class names the converter knows under the released checkpoint's (remote-code) name: the
converter registers Phi-3.5-MoE as PhiMoEForCausalLM, which its config.json names; transformers' own Phimoe writes
PhimoeForCausalLM, with the same tensor names."""


def _phimoe_defaults(config: dict[str, Any]) -> None:
    """Phi-3.5-MoE's converter reads original_max_position_embeddings (its long-rope base). The bench's phimoe config
    (specter.bench.synthetic.SHAPES) leaves rope scaling out, i.e. no scaling: the original length is the length."""
    config.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))


HPARAM_DEFAULTS = {"phimoe": _phimoe_defaults}
"""Per model_type, config fields the converter requires and the bench's configs omit, filled in at load time."""
PROBE = "def f(x):\n\treturn x  # café ∑ 🙂 \\n 'quoted' \x0b\x7f"


def is_byte_tokenizer(model_dir: Path) -> bool:
    """True for the bench's tokenizer: 256 tokens, no merges, every text encoded as its UTF-8 bytes."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return False
    spec = json.loads(path.read_text())
    model = spec.get("model", {})
    if model.get("type") != "BPE" or model.get("merges") or len(model.get("vocab", {})) != 256:
        return False
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path)).encode(PROBE, add_special_tokens=False).ids == list(PROBE.encode())


def convert_main(tree: Path, argv: list[str], widen: int | None = None, spill: Path | None = None,
                 room: int | None = None) -> None:
    """convert_hf_to_gguf.py's main() with argv, in this process; for a byte tokenizer, `set_vocab` of the chosen
    model class becomes the converter's own GPT-2 path with BYTE_PRE declared and INERT_MERGE added (module doc).
    `widen`: the model dir is a narrow checkpoint, converted as its widened model (see `widened_shell`). `spill`:
    the shards that do not fit in `room` bytes beside the output go there (`spill_shards`)."""
    sys.path[:0] = [str(tree), str(tree / "gguf-py")]
    import convert_hf_to_gguf as converter  # the tree's converter and its gguf-py, not an installed gguf
    from conversion.base import ModelBase
    from gguf.gguf_writer import GGUFWriter

    if spill is not None:
        spill_shards(GGUFWriter, spill, room)

    position = next(i for i, a in enumerate(argv) if not a.startswith("-") and Path(a).is_dir())
    model_dir = Path(argv[position])
    original, byte_vocab = converter.get_model_class, is_byte_tokenizer(model_dir)

    def get_model_class(name: str, mmproj: bool = False) -> type:
        model_class = original(ARCH_ALIASES.get(name, name), mmproj=mmproj)
        if byte_vocab and not mmproj:
            model_class.set_vocab = _byte_set_vocab
        return model_class

    converter.get_model_class = get_model_class
    load_hparams = ModelBase.load_hparams

    def load_hparams_with_defaults(dir_model: Path, is_mistral_format: bool) -> dict[str, Any]:
        config = load_hparams(dir_model, is_mistral_format)
        HPARAM_DEFAULTS.get(config.get("model_type", ""), lambda c: None)(config)
        return config

    ModelBase.load_hparams = staticmethod(load_hparams_with_defaults)
    fast_bf16_rounding(sys.modules["gguf.quants"])
    if widen is not None:
        argv = [*argv[:position], str(widened_shell(model_dir, widen, ModelBase)), *argv[position + 1 :]]
    sys.argv = ["convert_hf_to_gguf.py", *argv]
    converter.main()


def fast_bf16_rounding(quants: Any) -> None:
    """gguf-py rounds float32 to BF16 with numpy over groups of 16 rows (`_apply_over_grouped_rows`), which took 45 %
    of a conversion here (35 of 76 s for 5.8 GB). The same rounding in one torch call: torch's float -> bfloat16 is
    the same round-to-nearest-even (ggml_compute_fp32_to_bf16, gguf.quants.BF16.quantize_blocks), so the bytes are
    identical (tests/test_llamacpp.py checks ties, subnormals, infinities); arrays with a NaN (whose payload the two
    could keep differently) and every other type take gguf-py's own path."""
    import numpy as np
    import torch

    grouped, bf16_rows = quants._apply_over_grouped_rows, quants.BF16.quantize_rows

    def apply_over_grouped_rows(func: Any, arr: Any, otype: Any, oshape: tuple[int, ...]) -> Any:
        if func != bf16_rows or arr.dtype != np.float32:
            return grouped(func, arr, otype, oshape)
        values = torch.from_numpy(np.ascontiguousarray(arr))
        if values.numel() and torch.isnan(values.amax()):  # amax propagates a NaN: one pass, nothing allocated
            return grouped(func, arr, otype, oshape)
        return values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8).reshape(oshape)

    quants._apply_over_grouped_rows = apply_over_grouped_rows


def widened_shell(narrow_dir: Path, factor: int, model_base: type) -> Path:
    """A folder with the widened model's config.json and the tokenizer files, and no weights: the converter's tensor
    index (`ModelBase.index_tensors`) is replaced by the narrow checkpoint's tensors widened as they are read
    (specter.bench.widen.WidenedCheckpoint, bfloat16), lazily, one at a time. So the GGUF is the only widened copy on
    disk: a widened checkpoint written first would double the disk (Qwen3-30B-A3B's is 56 GiB of a 64 GiB disk)."""
    import tempfile

    import torch
    from conversion.base import LazyTorchTensor

    from specter.bench.widen import TOKENIZER_FILES, WidenedCheckpoint, widen_tensor

    wide = WidenedCheckpoint(narrow_dir, factor, torch.bfloat16)
    shell = Path(tempfile.mkdtemp(prefix="widened-")) / f"{narrow_dir.name}-x{factor}"  # the GGUF's general.name
    shell.mkdir()
    atexit.register(shutil.rmtree, shell.parent, True)
    (shell / "config.json").write_text(json.dumps(wide.config, indent=1))
    for name in TOKENIZER_FILES:
        if (narrow_dir / name).is_file():
            shutil.copyfile(narrow_dir / name, shell / name)

    def wide_shape(name: str) -> tuple[int, ...]:  # the widening rule applied to a meta tensor: no data read
        source = "model.embed_tokens.weight" if wide.tied and name == "lm_head.weight" else name
        meta = torch.empty(wide.narrow.shape(source), dtype=torch.bfloat16, device="meta")
        return tuple(widen_tensor(name, meta, wide.narrow.spec, factor).shape)

    def index_tensors(self: Any, remote_hf_model_id: str | None = None) -> dict[str, Any]:
        tensors = {}
        for name in wide.names():
            if self.lazy:
                meta = LazyTorchTensor.meta_with_dtype_and_shape(torch.bfloat16, wide_shape(name))
                generate = (lambda name=name, meta=meta: LazyTorchTensor(meta=meta, args=(name,), func=wide.tensor))
            else:
                generate = (lambda name=name: wide.tensor(name))
            if item := self.filter_tensors((name, generate)):
                tensors[item[0]] = item[1]
        return tensors

    model_base.index_tensors = index_tensors
    return shell


def _byte_set_vocab(self: Any) -> None:
    self.get_vocab_base_pre = lambda tokenizer: BYTE_PRE  # instead of the hash table, for this instance only
    self._set_vocab_gpt2()
    self.gguf_writer.add_token_merges([INERT_MERGE])


DEFAULT_SHARD_BYTES = 8 * GiB
"""`convert --spill`'s shard size: small against either directory's room, so little of it is left unused."""
SHARD_NAME = re.compile(r"^(?P<stem>.+)-(?P<number>\d{5})-of-(?P<count>\d{5})\.gguf$")
"""gguf-py's shard names (gguf_writer.SHARD_NAME_FORMAT), which llama.cpp's loader expects of a split GGUF."""


def convert(model_dir: Path, outfile: Path, outtype: str = "bf16", tree: Path = TREE, log: Path | None = None,
            widen: int | None = None, spill: Path | None = None, shard_bytes: int = DEFAULT_SHARD_BYTES,
            room: int | None = None) -> dict[str, Any]:
    """Run the converter in a child process (its memory and logging stay out of this one); timed. `widen`: the
    checkpoint is narrow, written as its widened model (`widened_shell`). The converter writes `partial_path(outfile)`,
    renamed to `outfile` only when it succeeded: a conversion stopped at the deadline (or failed) leaves no file that
    `all` would take for a finished GGUF next time (it skips converting when the GGUF exists), and a leftover partial
    file of an earlier call is removed first, and so is an earlier `outfile` (this conversion replaces it): their
    space is free for this one, as `check_disk` counts it.

    `spill`: a second directory, on another file system, for a GGUF larger than `outfile`'s directory should hold (the
    one-GPU machine's disk, about 64 GiB, holds neither Phi's 77.5 GiB GGUF nor Mixtral's 86.5, and its /dev/shm is its
    128 GiB of memory, which the GGUF would leave too little of): the converter writes
    shards of at most `shard_bytes` (its --split-max-size), those that fit in `outfile`'s directory there and the rest
    in `spill`, each linked into `outfile`'s directory (`place_shards`), so that llama.cpp finds one split GGUF in one
    directory. `outfile` is then a link to the first shard, made when the conversion succeeded (`model_file` gives
    llama.cpp that shard's name, from which it finds the others). `room`: the bytes the shards may take in `outfile`'s
    directory (default: its free space less 1 GiB)."""
    outfile.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(outfile)
    drop(outfile)
    if spill is not None:
        spill = spill.resolve()  # the links are made in outfile's directory: a relative target would dangle
        spill.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "_convert", "--tree", str(tree), "--widen", str(widen or 0),
           "--spill", str(spill or ""), "--room", str(-1 if room is None else room), "--", str(model_dir), "--outfile",
           str(partial), "--outtype", outtype, *(["--split-max-size", str(shard_bytes)] if spill is not None else [])]
    started = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=time_left(7200))
    except subprocess.TimeoutExpired as stopped:
        done = subprocess.CompletedProcess(cmd, 124, _text(stopped.stdout), _text(stopped.stderr) + "\nError: stopped at the deadline\n")
    seconds = time.monotonic() - started
    if log is not None:
        log.write_text(done.stdout + done.stderr)
    record = {"model": str(model_dir), "gguf": str(outfile), "outtype": outtype, "seconds": round(seconds, 1),
              "rc": done.returncode, "byte_tokenizer": is_byte_tokenizer(model_dir), "widen": widen}
    shards = written_files(outfile)
    if done.returncode == 0 and shards:
        record["bytes"] = sum(shard.stat().st_size for shard in shards)
        if shards == [partial]:  # one file: the converter did not split (or was not asked to)
            partial.replace(outfile)
        else:  # the shards keep their names (llama.cpp derives the others from the first's); the link marks them done
            outfile.symlink_to(shards[0].name)
            record["shards"] = [str(shard) + (f" -> {shard.resolve()}" if shard.is_symlink() else "") for shard in shards]
    else:
        drop(outfile)
        record["rc"] = done.returncode or 1
        record["error"] = _last_error(done.stderr) if done.returncode else f"the converter wrote no {partial}"
    return record


def partial_path(outfile: Path) -> Path:
    """Where `convert` writes before the GGUF is complete (split, gguf-py names the shards from its stem: NAME.gguf-
    00001-of-0000N.gguf and so on; only the link `convert` makes at NAME.gguf marks them finished)."""
    return outfile.with_name(outfile.name + ".partial")


def read_manifest(gguf: Path) -> dict[str, list[str]]:
    """The manifest of a split conversion to `gguf` (`spill_shards`); empty when there is none."""
    manifest = manifest_path(gguf)
    if not manifest.is_file():
        return {}
    try:
        return json.loads(manifest.read_text())
    except ValueError as error:
        raise SystemExit(f"{manifest} is not the manifest convert writes ({error}); delete it and the shards beside "
                         f"{gguf} by hand") from error


def written_files(gguf: Path) -> list[Path]:
    """What the converter wrote for a conversion to `gguf` (at `partial_path(gguf)`): its shards in order, as its
    manifest lists them (`spill_shards`), else the one partial file; empty when it wrote none."""
    listed = read_manifest(gguf)
    if listed:
        return [Path(name) for name in listed["shards"]]
    partial = partial_path(gguf)
    return [partial] if partial.is_file() else []


def gguf_files(gguf: Path) -> list[Path]:
    """Every file of the GGUF llama.cpp reads for `gguf` (`model_file`): that file, or all of its shards."""
    first = model_file(gguf)
    match = SHARD_NAME.match(first.name)
    if match is None:
        return [first]
    count = int(match["count"])
    return [first.with_name(f"{match['stem']}-{number:05d}-of-{count:05d}.gguf") for number in range(1, count + 1)]


def model_file(gguf: Path) -> Path:
    """The file to give llama.cpp for `gguf`: itself, or where `convert --spill` linked it, its first shard."""
    return gguf.parent / os.readlink(gguf) if gguf.is_symlink() and SHARD_NAME.match(os.readlink(gguf)) else gguf


def manifest_path(gguf: Path) -> Path:
    """Where a split conversion to `gguf` lists the files it made (`spill_shards`): what `drop` deletes, and only that."""
    return gguf.with_name(gguf.name + ".shards.json")


def drop(gguf: Path) -> list[str]:
    """Delete a GGUF `convert` wrote at `gguf`: the file, or the link and every shard and spilled file its manifest
    lists (a partial conversion's too); returns what it removed (`reproduce.sh llamacpp-matrix`'s DROP_GGUF). A plain
    file at `gguf` goes too, whoever wrote it (as `convert` replaces it); a link there is removed alone, never what it
    points to."""
    removed = []
    for path in ours(gguf):
        path.unlink()  # (a link is removed as a link: unlink never follows it)
        removed.append(str(path))
    return removed


def ours(gguf: Path) -> list[Path]:
    """The files and links `drop(gguf)` deletes: the manifest's spilled files and shards, the partial file, `gguf`
    itself and the manifest, those that exist."""
    listed = read_manifest(gguf)
    names = [*listed.get("spilled", []), *listed.get("shards", []), str(partial_path(gguf)), str(gguf), str(manifest_path(gguf))]
    return [path for path in map(Path, dict.fromkeys(names)) if path.is_symlink() or path.is_file()]


def place_shards(sizes: Sequence[int], room: int) -> list[bool]:
    """Per shard in order, whether it goes to the spill directory: shards stay while `room` bytes of the GGUF's
    directory hold them; from the first that does not fit (the first shard too, if it does not), every one spills."""
    spilled, out = False, []
    for size in sizes:
        spilled = spilled or size > room
        room -= 0 if spilled else size
        out.append(spilled)
    return out


def spill_shards(writer_class: Any, spill: Path, room: int | None = None) -> None:
    """Make gguf-py's writer place a split GGUF's shards as `place_shards` says, in `room` bytes of the GGUF's
    directory (None: its free space less 1 GiB): a shard that spills is created in `spill` (an absolute path) and
    linked under its name in the GGUF's directory, which the writer then opens through the link. Every file made is
    listed in `manifest_path` first, so that a conversion stopped at any point leaves `drop` what to delete. A spill
    file already there (another GGUF's shard of the same name) is refused, not overwritten."""
    names = writer_class.format_shard_names

    def placed(self: Any, path: Path) -> list[Path]:
        paths = names(self, path)
        manifest = manifest_path(path.with_name(path.name.removesuffix(".partial")))  # (path: `partial_path`'s)
        if len(paths) > 1 and not manifest.is_file():
            sizes = [sum(info.nbytes for info in tensors.values()) for tensors in self.tensors]
            free = shutil.disk_usage(path.parent).free - GiB
            here = free if room is None else min(room, free)
            targets = {shard: spill / shard.name for shard, spills in zip(paths, place_shards(sizes, here)) if spills}
            taken = [str(target) for target in targets.values() if target.exists() or target.is_symlink()]
            if taken:
                raise FileExistsError(f"spill files already there: {taken}; drop the GGUF they belong to first")
            written = manifest.with_name(manifest.name + ".tmp")  # whole or absent: a child killed here leaves no half
            written.write_text(json.dumps(
                {"shards": [str(shard) for shard in paths], "spilled": [str(target) for target in targets.values()]}))
            os.replace(written, manifest)
            for shard, target in targets.items():
                target.touch()
                shard.unlink(missing_ok=True)
                shard.symlink_to(target)
        return paths

    writer_class.format_shard_names = placed


def gguf_bytes_estimate(model_dir: Path, widen: int | None = None, element_size: int = 2) -> int:
    """The tensor bytes of the (widened) model in a 16-bit GGUF, from shapes alone (safetensors headers, meta tensors)."""
    import torch

    from specter.bench.widen import WidenedCheckpoint, widen_tensor
    from specter.model.checkpoint import Checkpoint

    if not widen:
        checkpoint = Checkpoint(model_dir)
        return sum(math.prod(checkpoint.shape(name)) for name in checkpoint.index) * element_size
    wide = WidenedCheckpoint(model_dir, widen, torch.bfloat16)
    total = 0
    for name in wide.names():
        source = "model.embed_tokens.weight" if wide.tied and name == "lm_head.weight" else name
        meta = torch.empty(wide.narrow.shape(source), dtype=torch.bfloat16, device="meta")
        total += widen_tensor(name, meta, wide.narrow.spec, widen).numel() * element_size
    return total


def check_disk(model_dir: Path, outfile: Path, widen: int | None, spill: Path | None = None, room: int | None = None,
               shard_bytes: int = DEFAULT_SHARD_BYTES) -> dict[str, Any]:
    """Refuse a conversion the disk cannot hold (the GPU machine has 64 GiB, the image's files included), counting the
    files of an earlier conversion there as free (`convert` drops them first); with `spill` (convert's), the GGUF's
    directory up to `room` bytes and the spill directory's file system too when it is another, 1 GiB kept spare in
    each and a shard's worth for the one that did not fit."""
    need = gguf_bytes_estimate(model_dir, widen)
    outfile.parent.mkdir(parents=True, exist_ok=True)
    here_dev = _device(outfile.parent)
    freed: dict[int, int] = {}
    for path in ours(outfile):
        if not path.is_symlink():
            device = _device(path)
            freed[device] = freed.get(device, 0) + path.stat().st_blocks * 512
    free = shutil.disk_usage(outfile.parent).free + freed.get(here_dev, 0)
    record: dict[str, Any] = {"gguf_bytes_estimate": need, "disk_free_bytes": free}
    if spill is None:
        record["fits"] = need + GiB < free
    else:
        spill.mkdir(parents=True, exist_ok=True)
        here = free - GiB if room is None else min(room, free - GiB)
        there_dev = _device(spill)
        there = (shutil.disk_usage(spill).free + freed.get(there_dev, 0) - GiB if there_dev != here_dev
                 else free - GiB - here)  # one file system: what the GGUF's directory leaves of it
        record |= {"room_bytes": here, "spill_free_bytes": there, "fits": need + shard_bytes <= here + there}
    if not record["fits"]:
        record["error"] = (f"the GGUF needs about {need / GiB:.1f} GiB and {outfile.parent} has {free / GiB:.1f} GiB free "
                           + (f"(with --spill {spill}: {record['spill_free_bytes'] / GiB:.1f} GiB more) " if spill else "")
                           + "(1 GiB kept spare); free the disk, convert with --widen F from the narrow checkpoint (no "
                           "widened safetensors beside it), write it to RAM (--gguf /dev/shm/NAME.gguf where the "
                           "machine's memory holds it) and spill the rest to another file system (--spill DIR), or use "
                           "a machine with a larger disk")
    return record


def _device(path: Path) -> int:
    """The file system `path` is on (st_dev)."""
    return os.stat(path).st_dev


def _last_error(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"Error|error:|Exception|raise ", line)]
    return (errors[-1] if errors else lines[-1] if lines else "no output")[:400]


# ---- plan: N for --n-cpu-moe ------------------------------------------------------------------------------------
EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(up|down|gate|gate_up)_(ch|)exps\.")
"""The tensors `--n-cpu-moe N` keeps on the CPU for blk.0 .. blk.N-1 (common.h's LLM_FFN_EXPS_REGEX)."""
HOST_TENSORS = ("token_embd.weight",)
"""Tensors llama.cpp keeps on the CPU whatever -ngl says (llama-model.cpp: "always keep [the input layer] on the CPU")."""
DEFAULT_OVERHEAD = 512 * MiB
"""The GPU bytes besides the weights (KV cache, compute and output buffers) assumed before a calibration run."""


def gguf_tensor_bytes(path: Path, tree: Path = TREE) -> dict[str, int]:
    """Bytes of every tensor of a GGUF file, by GGUF name (gguf-py from the staged tree)."""
    sys.path[:0] = [str(tree / "gguf-py")]
    from gguf import GGUFReader

    return {tensor.name: int(tensor.n_bytes) for shard in gguf_files(path) for tensor in GGUFReader(str(shard)).tensors}


def split_bytes(tensors: dict[str, int]) -> tuple[list[int], int, int]:
    """(routed expert bytes per layer index, other bytes -ngl 99 puts on the GPU, bytes kept on the host)."""
    layers: dict[int, int] = {}
    gpu = host = 0
    for name, size in tensors.items():
        expert = EXPERT_TENSOR.match(name)
        if expert:
            layers[int(expert.group(1))] = layers.get(int(expert.group(1)), 0) + size
        elif name in HOST_TENSORS:
            host += size
        else:
            gpu += size
    per_layer = [layers.get(i, 0) for i in range(max(layers, default=-1) + 1)]
    return per_layer, gpu, host


def choose_n_cpu_moe(layer_expert_bytes: Sequence[int], fixed_gpu_bytes: int, budget: int,
                     overhead: int = DEFAULT_OVERHEAD) -> dict[str, Any]:
    """The smallest N whose GPU memory (fixed + overhead + the experts of layers N..) fits `budget`: llama.cpp's
    best use of the same GPU memory. `fits` is False when even N = every layer does not fit (then N = that)."""
    gpu_experts = sum(layer_expert_bytes)
    for n in range(len(layer_expert_bytes) + 1):
        gpu = fixed_gpu_bytes + overhead + gpu_experts
        if gpu <= budget:
            return {"n_cpu_moe": n, "gpu_bytes": gpu, "fits": True, "budget": budget, "overhead": overhead,
                    "fixed_gpu_bytes": fixed_gpu_bytes, "gpu_expert_bytes": gpu_experts,
                    "cpu_expert_bytes": sum(layer_expert_bytes) - gpu_experts}
        if n < len(layer_expert_bytes):
            gpu_experts -= layer_expert_bytes[n]
    n = len(layer_expert_bytes)
    return {"n_cpu_moe": n, "gpu_bytes": fixed_gpu_bytes + overhead, "fits": False, "budget": budget, "overhead": overhead,
            "fixed_gpu_bytes": fixed_gpu_bytes, "gpu_expert_bytes": 0, "cpu_expert_bytes": sum(layer_expert_bytes)}


def specter_budget(model_dir: Path, residents: int, max_context: int, dtype: str = "bfloat16", widen: int | None = None) -> int:
    """The GPU bytes Specter's own memory plan takes at `residents` expert slots per layer (for --residents)."""
    import torch

    from specter.config import EngineConfig
    from specter.memory import plan_memory
    from specter.model.checkpoint import Checkpoint

    if widen:
        from specter.bench.widen import WidenedCheckpoint

        checkpoint = WidenedCheckpoint(model_dir, widen, getattr(torch, dtype))
    else:
        checkpoint = Checkpoint(model_dir)
    spec = checkpoint.spec
    checkpoint.close()
    plan = plan_memory(spec, getattr(torch, dtype), EngineConfig(residents=residents, max_context=max_context))
    return plan.device_bytes


# ---- run: llama.cpp's output, parsed --------------------------------------------------------------------------
_PERF = re.compile(r"(?P<what>prompt eval time|eval time|load time|total time|sampling time)\s*=\s*(?P<ms>[\d.]+) ms"
                   r"(?:\s*/\s*(?P<count>\d+) (?:runs|tokens))?")
_BUFFER = re.compile(r"(?P<name>\S+)\s+(?P<kind>model|KV|compute|output|RS) buffer size =\s*(?P<mib>[\d.]+) MiB")
_PROMPT_TOKEN = re.compile(r"^(?:[\d.]+ I )?\s*(\d+) -> '")  # after the log prefix (time, level) when there is one


def parse_timings(text: str) -> dict[str, Any]:
    """llama.cpp's own perf lines (llama_perf_context_print / llama_perf_sampler_print) and its buffer sizes.

    TPOT is eval time over eval runs: every generated token after the first, which the prompt's evaluation gives."""
    out: dict[str, Any] = {}
    for match in _PERF.finditer(text):
        key = match["what"].replace(" ", "_")
        out[f"{key}_ms"] = float(match["ms"])
        if match["count"] is not None:
            out[f"{key}_count"] = int(match["count"])
    if out.get("eval_time_count"):
        out["tpot_ms"] = out["eval_time_ms"] / out["eval_time_count"]
    if out.get("prompt_eval_time_count"):
        out["prefill_ms_per_token"] = out["prompt_eval_time_ms"] / out["prompt_eval_time_count"]
    buffers: dict[str, float] = {}
    for match in _BUFFER.finditer(text):
        key = f"{match['name']} {match['kind']}"
        buffers[key] = buffers.get(key, 0.0) + float(match["mib"])
    out["buffers_mib"] = buffers
    system = re.search(r"system_info: n_threads = (\d+).*", text)
    if system:
        out["n_threads"], out["system_info"] = int(system.group(1)), system.group(0)[:600]
    out["gpu_mib"] = sum(mib for key, mib in buffers.items() if _on_gpu(key.split()[0]))
    return out


def _on_gpu(buffer_name: str) -> bool:
    """CUDA0, CUDA1 ...: device memory; CUDA_Host is pinned host memory, CPU* is host memory."""
    return buffer_name.startswith("CUDA") and not buffer_name.startswith("CUDA_Host")


def parse_prompt_tokens(text: str) -> list[int]:
    """The prompt ids llama-completion printed with --verbose-prompt (lines `   123 -> 'x'`)."""
    return [int(m.group(1)) for m in map(_PROMPT_TOKEN.match, text.splitlines()) if m]


def parse_llama_bench(text: str) -> list[dict[str, Any]]:
    """llama-bench -o json: one record per test (n_gen > 0: token generation, avg_ts tokens/s)."""
    start = text.find("[")
    records = json.loads(text[start : text.rindex("]") + 1]) if start >= 0 else []
    for record in records:
        if record.get("avg_ts"):
            record["ms_per_token"] = 1e3 / record["avg_ts"]
    return records



def generated_ids(stdout: bytes) -> tuple[list[int], bool]:
    """(the generated ids, stopped at an end-of-generation token) from llama-completion's stdout under
    --no-display-prompt: the pieces of the generated tokens, " [end of text]" when it stopped early, then "\\n\\n".
    Exact for a byte vocabulary (a token's piece is its one byte)."""
    text = stdout[:-2] if stdout.endswith(b"\n\n") else stdout
    stopped = text.endswith(b" [end of text]\n")
    return list(text[: -len(b" [end of text]\n")] if stopped else text), stopped


# ---- run --------------------------------------------------------------------------------------------------------
def checkpoint_prompts(model_dir: Path, per_kind: int) -> list[dict[str, Any]]:
    """The bench's prompts (specter.bench.protocol.checkpoint_prompts): prompts.json's first `per_kind` of each kind."""
    listed = json.loads((model_dir / "prompts.json").read_text())["kinds"]
    from specter.bench.protocol import PROMPT_TOKENS

    return [{"kind": kind, "index": i, "ids": [int(t) for t in ids][:PROMPT_TOKENS]}
            for kind, snippets in listed.items() for i, ids in enumerate(snippets[:per_kind])]


def completion_command(binary: Path, gguf: Path, prompt: bytes, n_predict: int, n_cpu_moe: int | None, ctx: int,
                       threads: int | None, gpu: bool, extra: Sequence[str] = ()) -> list[str | bytes]:
    """llama-completion, greedy (--temp 0: the temp-ext sampler keeps only the largest logit), exactly n_predict
    tokens (--ignore-eos: a vocabulary without an end token gets llama.cpp's BPE default, id 11, byte 0x0B, which
    would end a run early; --ignore-eos masks it instead, see `agree`), the prompt as raw bytes (no escape
    processing), its ids printed (--verbose-prompt), --fit off (N and the context are ours, not fitted), -lv 4 for
    the buffer sizes (a few lines at load, none per token)."""
    cmd: list[str | bytes] = [str(binary), "-m", str(gguf), "-p", prompt, "-n", str(n_predict), "--temp", "0", "-s", "0",
                              "-c", str(ctx), "-no-cnv", "--no-escape", "--verbose-prompt", "--no-display-prompt",
                              "--ignore-eos", "-fit", "off", "-lv", "4"] + (["-ngl", "99"] if gpu else [])
    if n_cpu_moe is not None:
        cmd += ["--n-cpu-moe", str(n_cpu_moe)]
    if threads:
        cmd += ["-t", str(threads)]
    return cmd + list(extra)


def run_prompt(cmd: list[str | bytes], n_predict: int, prompt_len: int, attempts: int = 4) -> dict[str, Any]:
    """One llama-completion run: its parsed timings, ids and raw output (stderr, with stdout's bytes escaped).

    llama.cpp's common log writes from a worker thread that nothing joins at exit (common/log.cpp, "logs may be lost
    if not flushed before the program exits"; llama-completion does not flush), so the last lines, the timings and
    the last tokens among them, are sometimes missing: 3 runs in 20, up to 1 in 4, on a busy 2-core CPU with a tiny
    model (a large model takes longer to free, which gives the thread time). A run missing them is repeated
    (`attempts` in the record)."""
    for attempt in range(1, attempts + 1):
        started = time.monotonic()
        try:
            done = subprocess.run(cmd, capture_output=True, timeout=time_left())
        except subprocess.TimeoutExpired as stopped:
            done = subprocess.CompletedProcess(cmd, 124, stopped.stdout or b"", (stopped.stderr or b"") + b"\nstopped at the deadline\n")
        stderr = done.stderr.decode("utf-8", "replace")
        record = parse_timings(stderr) | {"rc": done.returncode, "wall_s": round(time.monotonic() - started, 2)}
        record["tokens"], record["stopped_early"] = generated_ids(done.stdout)
        record["prompt_tokens"] = parse_prompt_tokens(stderr)
        record["raw"] = stderr + "\n--- stdout (bytes) ---\n" + repr(done.stdout) + "\n"
        record["attempts"] = attempt
        complete = "tpot_ms" in record and (len(record["tokens"]) == n_predict or record["stopped_early"])
        if done.returncode != 0 or (complete and len(record["prompt_tokens"]) == prompt_len) or time_left() < 2:
            break
    return record


def run_checkpoint(model_dir: Path, gguf: Path, bin_dir: Path, out: Path, *, budget: int | None, n_cpu_moe: int | None,
                   per_kind: int, n_predict: int, ctx: int, threads: int | None, gpu: bool, bench: bool, label: str,
                   overhead: int = DEFAULT_OVERHEAD, calibrate: bool = True, tree: Path = TREE,
                   extra: Sequence[str] = (), widen: int | None = None) -> dict[str, Any]:
    """Plan N (unless given), calibrate the overhead with one short run, then every prompt, then llama-bench.
    Writes out/raw-LABEL.log (every run's output) and out/summary-LABEL.json; returns the summary."""
    out.mkdir(parents=True, exist_ok=True)
    gguf = model_file(gguf)  # a split GGUF: its first shard, from whose name llama.cpp finds the others
    completion = bin_dir / "llama-completion"
    raw: list[str] = []
    summary: dict[str, Any] = {"label": label, "model": str(model_dir), "gguf": str(gguf), "gpu": gpu,
                               "n_predict": n_predict, "ctx": ctx, "threads": threads, "extra_args": list(extra), "widen": widen,
                               "llama_cpp": staged_version(tree)}
    layer_bytes, fixed_gpu, host = split_bytes(gguf_tensor_bytes(gguf, tree))
    summary["bytes"] = {"expert_per_layer": layer_bytes, "fixed_gpu": fixed_gpu, "host_only": host}
    prompts = checkpoint_prompts(model_dir, per_kind)
    if n_cpu_moe is None and budget is not None:
        plan = choose_n_cpu_moe(layer_bytes, fixed_gpu, budget, overhead)
        if calibrate and gpu:
            probe = run_prompt(completion_command(completion, gguf, bytes(prompts[0]["ids"]), 4, plan["n_cpu_moe"], ctx,
                                                  threads, gpu, extra), 4, len(prompts[0]["ids"]))
            raw.append(f"=== calibration N={plan['n_cpu_moe']}\n{probe.pop('raw')}")
            measured = _measured_overhead(probe, plan)
            if measured is not None:
                plan = choose_n_cpu_moe(layer_bytes, fixed_gpu, budget, measured) | {"estimated_overhead": overhead,
                                                                                     "calibration": probe}
        n_cpu_moe = plan["n_cpu_moe"]
        summary["plan"] = plan
    summary["n_cpu_moe"] = n_cpu_moe
    summary["prompts"] = []
    for prompt in prompts:
        record = run_prompt(completion_command(completion, gguf, bytes(prompt["ids"]), n_predict, n_cpu_moe, ctx, threads, gpu,
                                               extra), n_predict, len(prompt["ids"]))
        raw.append(f"=== prompt {prompt['kind']} {prompt['index']} N={n_cpu_moe}\n{record.pop('raw')}")
        record["prompt_ok"] = record["prompt_tokens"] == prompt["ids"]
        summary["prompts"].append(prompt | record)
    if bench:
        summary["llama_bench"] = run_llama_bench(bin_dir / "llama-bench", gguf, n_predict, n_cpu_moe, threads, gpu, raw)
    summary |= _aggregate(summary["prompts"], budget)
    (out / f"raw-{label}.log").write_text("\n".join(raw))
    (out / f"summary-{label}.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _measured_overhead(probe: dict[str, Any], plan: dict[str, Any]) -> int | None:
    """GPU bytes besides the weights in a calibration run: its CUDA buffers less the weights the plan put there."""
    buffers = probe.get("buffers_mib", {}) if probe.get("rc") == 0 else {}
    model = sum(mib for key, mib in buffers.items() if key.endswith(" model") and _on_gpu(key.split()[0]))
    if not model:
        return None
    return int((probe["gpu_mib"] - model) * MiB)


def run_llama_bench(binary: Path, gguf: Path, n_gen: int, n_cpu_moe: int | None, threads: int | None, gpu: bool,
                    raw: list[str]) -> list[dict[str, Any]]:
    """llama-bench's own token-generation figure (tg at n_gen tokens, 3 repetitions) at the same N."""
    cmd = [str(binary), "-m", str(gguf), "-p", "0", "-n", str(n_gen), "-r", "3", "-o", "json"] + (["-ngl", "99"] if gpu else [])
    if n_cpu_moe is not None:
        cmd += ["-ncmoe", str(n_cpu_moe)]
    if threads:
        cmd += ["-t", str(threads)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=time_left())
    except subprocess.TimeoutExpired as stopped:
        done = subprocess.CompletedProcess(cmd, 124, _text(stopped.stdout), _text(stopped.stderr) + "\nstopped at the deadline\n")
    raw.append(f"=== llama-bench {' '.join(cmd)}\n{done.stderr}\n--- stdout ---\n{done.stdout}")
    if done.returncode != 0:
        return [{"rc": done.returncode, "error": _last_error(done.stderr)}]
    return parse_llama_bench(done.stdout)


def _aggregate(records: list[dict[str, Any]], budget: int | None) -> dict[str, Any]:
    tpots = sorted(r["tpot_ms"] for r in records if "tpot_ms" in r)
    gpu = max((r.get("gpu_mib", 0.0) for r in records), default=0.0)
    return {"tpot_ms_mean": sum(tpots) / len(tpots) if tpots else None,
            "tpot_ms_median": tpots[len(tpots) // 2] if tpots else None, "runs_ok": sum(r["rc"] == 0 for r in records),
            "prompts_ok": all(r.get("prompt_ok") for r in records), "gpu_mib_measured": gpu,
            "budget_mib": budget / MiB if budget else None,
            "within_budget": None if budget is None else gpu * MiB <= budget}


def staged_version(tree: Path = TREE) -> dict[str, Any]:
    staged = tree / "STAGED.json"
    return json.loads(staged.read_text()) if staged.is_file() else {}



# ---- agree: llama.cpp's greedy tokens against Specter's -------------------------------------------------------------
def specter_greedy(model_dir: Path, prompts: list[list[int]], n_predict: int, device: str, dtype: str,
                   widen: int | None = None) -> list[list[int]]:
    """Specter's greedy tokens for each prompt, every expert resident (the target's own tokens); `widen`: the narrow
    checkpoint read widened on `device` (as the bench reads it: on CUDA the widening is off the host, the same values
    bit for bit; on the host it took most of the time of an agree at the widened Qwen1.5-MoE dims)."""
    import asyncio

    import torch

    from specter.build import CheckpointWeights
    from specter.config import EngineConfig, GenerationConfig
    from specter.engine import Runtime
    from specter.model.checkpoint import Checkpoint

    async def generate() -> list[list[int]]:
        if widen:
            from specter.bench.widen import WidenedCheckpoint

            checkpoint = WidenedCheckpoint(model_dir, widen, torch.bfloat16 if dtype in ("auto", "bfloat16") else None,
                                           device)
        else:
            checkpoint = Checkpoint(model_dir)
        config = EngineConfig(device=device, dtype=dtype, max_context=max(len(p) for p in prompts) + n_predict + 8)
        runtime = await Runtime.build(CheckpointWeights(checkpoint), config)
        try:
            return [(await runtime.complete_ids(ids, GenerationConfig(max_new_tokens=n_predict))).tokens for ids in prompts]
        finally:
            await runtime.aclose()

    return asyncio.run(generate())


MASKED_EOS = 11
"""llama.cpp's end-of-text id for a BPE vocabulary that names none (llama-vocab.cpp: special_eos_id = 11)."""


def matching_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return min(len(a), len(b))


def agree(summary_path: Path, device: str, dtype: str) -> dict[str, Any]:
    """Per prompt of a `run` summary: how many leading tokens llama.cpp and Specter share (rounding differs, so this
    is a prefix length, not a pass/fail)."""
    summary = json.loads(summary_path.read_text())
    prompts = [p for p in summary["prompts"] if p.get("tokens")]
    ours = specter_greedy(Path(summary["model"]), [p["ids"] for p in prompts], summary["n_predict"], device, dtype,
                          summary.get("widen"))
    rows = [{"kind": p["kind"], "index": p["index"], "prefix": matching_prefix(p["tokens"], mine), "of": len(mine),
             "llama_cpp": p["tokens"], "specter": mine} for p, mine in zip(prompts, ours)]
    for row in rows:
        if row["prefix"] < min(len(row["llama_cpp"]), row["of"]) and row["specter"][row["prefix"]] == MASKED_EOS:
            row["note"] = f"Specter's next token is {MASKED_EOS}, llama.cpp's default end token, which --ignore-eos masks"
    record = {"summary": str(summary_path), "device": device, "dtype": dtype, "gguf": summary["gguf"],
              "widen": summary.get("widen"), "prompts": rows,
              "min_prefix": min((r["prefix"] for r in rows), default=0), "all_equal": all(r["prefix"] == r["of"] for r in rows)}
    summary_path.with_name(summary_path.name.replace("summary-", "agree-")).write_text(json.dumps(record, indent=1) + "\n")
    return record


# ---- CLI --------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python benchmarks/llamacpp.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    stage_p = sub.add_parser("stage", help="trim llama.cpp out of the llama-cpp-python sdist")
    stage_p.add_argument("--sdist", type=Path, required=True,
                         help="llama_cpp_python-*.tar.gz (pip download --no-deps --no-binary :all: llama-cpp-python)")
    stage_p.add_argument("--dest", type=Path, default=TREE)
    for name in ("build", "all"):
        p = sub.add_parser(name, help="cmake + ninja of " + ", ".join(TARGETS) if name == "build" else
                           "build (CUDA), convert, plan and run: the GPU flow")
        p.add_argument("--tree", type=Path, default=TREE)
        p.add_argument("--build-dir", type=Path, default=None, help="default /tmp/llama.cpp-build-cuda (or -cpu)")
        p.add_argument("--jobs", type=int, default=None, help="ninja -j (default: ninja's, the cores)")
        p.add_argument("--no-fa-kernels", action="store_true",
                       help="-DGGML_CUDA_FA=OFF: no CUDA flash-attention kernels, a quicker build (build dir suffix -nofa)")
        if name == "build":
            p.add_argument("--cuda", action="store_true", help="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90")
            p.add_argument("--deadline-s", type=float, default=None, help="stop ninja after this many seconds")
            p.add_argument("--log", type=Path, default=None, help="cmake and ninja output (appended); default BUILD_DIR/build.log")
    conv = sub.add_parser("convert", help="HF checkpoint dir -> GGUF with llama.cpp's converter")
    conv.add_argument("model", type=Path)
    conv.add_argument("--outfile", type=Path, required=True)
    conv.add_argument("--outtype", default="bf16", choices=["f32", "f16", "bf16"])
    conv.add_argument("--tree", type=Path, default=TREE)
    plan_p = sub.add_parser("plan", help="N for --n-cpu-moe at a GPU budget, from a GGUF")
    plan_p.add_argument("gguf", type=Path)
    plan_p.add_argument("--tree", type=Path, default=TREE)
    for p in (plan_p, sub.choices["all"]):
        _budget_args(p)
    run_p = sub.add_parser("run", help="llama-completion greedy on the checkpoint's prompts, llama-bench; JSON")
    run_p.add_argument("--gguf", type=Path, required=True)
    run_p.add_argument("--bin-dir", type=Path, required=True, help="the build's bin/ folder")
    run_p.add_argument("--tree", type=Path, default=TREE)
    for p in (run_p, sub.choices["all"]):
        p.add_argument("model", type=Path, help="the checkpoint dir (config.json, prompts.json)")
        p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")) / "llamacpp")
        p.add_argument("--label", default=None, help="default: the checkpoint dir's name and the budget")
        p.add_argument("--per-kind", type=int, default=1, help="prompts of each kind (the bench's --prompts)")
        p.add_argument("--n-predict", type=int, default=128, help="tokens generated per prompt (the bench's --max-new-tokens)")
        p.add_argument("--ctx", type=int, default=512)
        p.add_argument("--threads", type=int, default=None, help="llama.cpp's -t (default: its own choice)")
        p.add_argument("--no-bench", action="store_true", help="skip llama-bench")
        p.add_argument("--extra-args", default="", help="more llama-completion arguments, one string (e.g. '-ctk f32 -ctv f32')")
        p.add_argument("--agree", action="store_true", help="then compare the tokens with Specter's (agree)")
        p.add_argument("--deadline-s", type=float, default=None,
                       help="stop every child (ninja, converter, llama.cpp) this many seconds after the start")
    run_p.add_argument("--cpu", action="store_true", help="-ngl 0: everything on the CPU (a CPU-only build)")
    _budget_args(run_p)
    sub.choices["all"].add_argument("--outtype", default="bf16", choices=["f32", "f16", "bf16"])
    sub.choices["all"].add_argument("--gguf", type=Path, default=None, help="default /tmp/llamacpp-gguf/<model dir name>[-x<F>]-<outtype>.gguf")
    for p in (conv, sub.choices["all"]):
        p.add_argument("--spill", type=Path, default=None, metavar="DIR",
                       help="a directory on another file system for the shards that do not fit beside the GGUF (it is then "
                            "written split, each spilled shard linked beside the others)")
        p.add_argument("--shard-gib", type=float, default=DEFAULT_SHARD_BYTES / GiB, help="shard size with --spill")
        p.add_argument("--room-gib", type=float, default=None,
                       help="with --spill, the GiB the GGUF's directory may take (default: its free space less 1 GiB; "
                            "cap it on a RAM-backed /dev/shm, whose free space is the machine's memory)")
    drop_p = sub.add_parser("drop", help="delete a GGUF convert wrote: the file at the path (whoever wrote it) or the "
                                         "link there, and the shards and spilled files its manifest lists")
    drop_p.add_argument("gguf", type=Path)
    for p in (conv, sub.choices["all"], run_p):
        p.add_argument("--widen", type=int, default=None, metavar="F",
                       help="the checkpoint is narrow: convert (and compare) its widened model (x F), no widened copy on disk")
    agree_p = sub.add_parser("agree", help="llama.cpp's greedy tokens (a run's summary) against Specter's")
    agree_p.add_argument("summary", type=Path)
    for p in (agree_p, run_p, sub.choices["all"]):
        p.add_argument("--device", default="auto", help="Specter's device for agree")
        p.add_argument("--dtype", default="auto", help="Specter's dtype for agree (match the GGUF: float32 or bfloat16)")
    return parser


def _budget_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--budget-gib", type=float, default=None, help="Specter's GPU budget (its --budget), GiB")
    group.add_argument("--residents", type=int, default=None,
                       help="Specter's expert slots per layer: the budget is what Specter's memory plan puts on the GPU then")
    group.add_argument("--n-cpu-moe", type=int, default=None, help="N itself, no planning")
    parser.add_argument("--overhead-mib", type=float, default=DEFAULT_OVERHEAD / MiB,
                        help="GPU memory besides weights assumed before calibration (KV, compute buffers)")


def _budget(args: argparse.Namespace, model_dir: Path | None) -> int | None:
    if args.budget_gib is not None:
        return int(args.budget_gib * GiB)
    if args.residents is not None:
        if model_dir is None:
            raise SystemExit("--residents needs the checkpoint dir (its memory plan)")
        return specter_budget(model_dir, args.residents, getattr(args, "ctx", 512), widen=getattr(args, "widen", None))
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "stage":
        record = stage(args.sdist, args.dest)
        ignore_tree(args.dest)
        print(json.dumps(record))
        return 0
    if args.command == "drop":
        print(json.dumps({"removed": drop(args.gguf)}))
        return 0
    if args.command == "convert":
        record = convert(args.model, args.outfile, args.outtype, args.tree, args.outfile.with_suffix(".convert.log"), args.widen,
                         args.spill, int(args.shard_gib * GiB), _gib(args.room_gib))
        print(json.dumps(record))
        return record["rc"]
    if args.command == "plan":
        layer_bytes, fixed, host = split_bytes(gguf_tensor_bytes(args.gguf, args.tree))
        budget = _budget(args, None)
        if budget is None:
            raise SystemExit("plan needs --budget-gib")
        plan = choose_n_cpu_moe(layer_bytes, fixed, budget, int(args.overhead_mib * MiB))
        print(json.dumps(plan | {"expert_bytes_per_layer": layer_bytes, "host_only_bytes": host}))
        print(f"budget {budget / GiB:.2f} GiB -> --n-cpu-moe {plan['n_cpu_moe']} (GPU {plan['gpu_bytes'] / GiB:.2f} GiB, "
              f"experts on the CPU {plan['cpu_expert_bytes'] / GiB:.2f} GiB)")
        return 0
    if args.command == "agree":
        return _print_agree(agree(args.summary, args.device, args.dtype))
    if args.command == "build":
        global DEADLINE
        DEADLINE = None if args.deadline_s is None else time.monotonic() + args.deadline_s
        build_dir = args.build_dir or _default_build_dir(args.cuda, args.no_fa_kernels)
        record = build(args.tree, build_dir, args.cuda, args.jobs, args.log or build_dir / "build.log", not args.no_fa_kernels)
        print(json.dumps(record))
        return record["rc"]
    return run_or_all(args)


def _gib(value: float | None) -> int | None:
    return None if value is None else int(value * GiB)


def _default_build_dir(cuda: bool, no_fa: bool) -> Path:
    return Path(f"/tmp/llama.cpp-build-{'cuda' if cuda else 'cpu'}{'-nofa' if cuda and no_fa else ''}")


def default_gguf(model_dir: Path, outtype: str, widen: int | None) -> Path:
    """`all`'s GGUF: named by the checkpoint, the widening and the type, so that a GGUF of the same narrow checkpoint
    converted at another factor (or not widened) is not taken for this one."""
    return Path(f"/tmp/llamacpp-gguf/{model_dir.name}{f'-x{widen}' if widen else ''}-{outtype}.gguf")


def run_or_all(args: argparse.Namespace) -> int:
    """`run` (a built binary, a converted GGUF) or `all` (build with CUDA, convert, then run)."""
    global DEADLINE
    DEADLINE = None if args.deadline_s is None else time.monotonic() + args.deadline_s
    args.out.mkdir(parents=True, exist_ok=True)
    steps: dict[str, Any] = {}
    gpu = args.command == "all" or not args.cpu
    bin_dir = getattr(args, "bin_dir", None)
    if args.command == "all":
        build_dir = args.build_dir or _default_build_dir(True, args.no_fa_kernels)
        steps["build"] = build(args.tree, build_dir, True, args.jobs, args.out / "build.log", not args.no_fa_kernels)
        print("build:", json.dumps(steps["build"]), flush=True)
        if steps["build"]["rc"] != 0:
            return 1
        bin_dir = build_dir / "bin"
        args.gguf = args.gguf or default_gguf(args.model, args.outtype, args.widen)
        if (not all(path.is_file() for path in gguf_files(args.gguf))  # (a split one: every shard, spilled ones too)
                or args.gguf.stat().st_mtime < (args.model / "config.json").stat().st_mtime):
            steps["disk"] = check_disk(args.model, args.gguf, args.widen, args.spill, _gib(args.room_gib), int(args.shard_gib * GiB))
            print("disk:", json.dumps(steps["disk"]), flush=True)
            if not steps["disk"]["fits"]:
                return 1
            steps["convert"] = convert(args.model, args.gguf, args.outtype, args.tree, args.out / "convert.log", args.widen,
                                       args.spill, int(args.shard_gib * GiB), _gib(args.room_gib))
            print("convert:", json.dumps(steps["convert"]), flush=True)
            if steps["convert"]["rc"] != 0:
                return 1
    budget = _budget(args, args.model)
    setting = (f"r{args.residents}" if args.residents is not None else f"{args.budget_gib:g}GiB" if args.budget_gib is not None
               else f"N{args.n_cpu_moe}" if args.n_cpu_moe is not None else "ngl-only")
    label = args.label or f"{args.model.name}{f'-x{args.widen}' if args.widen else ''}-{setting}"
    summary = run_checkpoint(args.model, args.gguf, bin_dir, args.out, budget=budget, n_cpu_moe=args.n_cpu_moe,
                             per_kind=args.per_kind, n_predict=args.n_predict, ctx=args.ctx, threads=args.threads, gpu=gpu,
                             bench=not args.no_bench, label=label, overhead=int(args.overhead_mib * MiB), tree=args.tree,
                             extra=shlex.split(args.extra_args), widen=getattr(args, "widen", None))
    summary["steps"] = steps
    (args.out / f"summary-{label}.json").write_text(json.dumps(summary, indent=1) + "\n")
    _print_summary(summary)
    if args.agree:
        _print_agree(agree(args.out / f"summary-{label}.json", args.device, args.dtype))
    return 0 if summary["runs_ok"] == len(summary["prompts"]) else 1


def _print_summary(summary: dict[str, Any]) -> None:
    plan = summary.get("plan", {})
    bench = [r for r in summary.get("llama_bench", []) if r.get("n_gen")]
    print(f"{summary['label']}: --n-cpu-moe {summary['n_cpu_moe']} of {len(summary['bytes']['expert_per_layer'])} layers; "
          f"budget {plan.get('budget', 0) / GiB:.2f} GiB, llama.cpp GPU buffers {summary['gpu_mib_measured'] / 1024:.2f} GiB "
          f"(planned {plan.get('gpu_bytes', 0) / GiB:.2f}{'' if plan.get('fits', True) else ', does not fit even with every layer on the CPU'}); TPOT mean {_ms(summary['tpot_ms_mean'])} median "
          f"{_ms(summary['tpot_ms_median'])} over {summary['runs_ok']} prompts (prompt ids exact: {summary['prompts_ok']})"
          + (f"; llama-bench tg{bench[0]['n_gen']} {bench[0]['ms_per_token']:.2f} ms/token" if bench else ""))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} ms"


def _print_agree(record: dict[str, Any]) -> int:
    for row in record["prompts"]:
        print(f"agree {row['kind']}[{row['index']}]: {row['prefix']}/{row['of']} leading tokens equal"
              + (f" ({row['note']})" if "note" in row else ""))
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["_convert"]:  # the child process of `convert`
    room_arg = int(sys.argv[9])
    convert_main(Path(sys.argv[3]), sys.argv[11:], int(sys.argv[5]) or None, Path(sys.argv[7]) if sys.argv[7] else None,
                 None if room_arg < 0 else room_arg)
elif __name__ == "__main__":
    sys.exit(main())
