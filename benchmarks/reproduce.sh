#!/usr/bin/env bash
# Regenerates the tables of docs/BENCHMARKS.md, one target per table, with the commands the tables state.
# GPU targets run on the GPU machine (an H200; an H100 where none is lent: Qwen3's full-depth training then needs
# RECOMPUTE_LAYERS, see train_length), one device call each (each fits its 10-minute limit); stage the wheels first
# (../shared/device/stage-wheels.sh) and carry .whl:
#   run(command="bash benchmarks/reproduce.sh qwen", carry=[".whl"])
# CPU targets (replay, cpu-quick) run on the development machine. Everything lands under $OUT (default out/).
# Targets: gpu-tests gpu-widen qwen qwen-traces replay draft-step floor resident-hf transfer kernels reference
#          reference-overlap paper-qwen paper-deepseek paper-phi paper-merge cpu-quick serve before-after engine-ab realism
#          hybrid llamacpp llamacpp-matrix fulldepth fulldepth-prepare host-expert host-job host-job-ab exact-rowwise cmd
set -u
out=${OUT:-out}
mkdir -p "$out/logs"
out=$(cd "$out" && pwd)  # absolute: targets run from other directories (the old tree, /tmp)
export PYTHONUNBUFFERED=1

gpu_setup() {  # the GPU machine has no registry: install the staged wheels and the project, no network
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . ./tests/dummy_plugin >/dev/null 2>&1 \
    || echo "editable install failed" >&2
  export SPECTER_CACHE=/tmp/specter-cache
}

gpu_widen() {  # table "GPU tests": widening on CUDA against the CPU, bit for bit, and widened loads' tokens; then its speed
  timeout 400 python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=120 tests/test_gpu_widen.py \
    > "$out/logs/gpu-widen.log" 2>&1
  tail -1 "$out/logs/gpu-widen.log"
  timeout 150 python3 benchmarks/widen_speed.py mixtral-8x7b 4 cuda 2>&1 | tail -3
}

train_qwen() {  # the Qwen1.5-MoE shape, 8 layers, trained on the stdlib corpus, into /tmp/qwenref (kept while warm)
  [ -f /tmp/qwenref/config.json ] && return
  timeout 200 python3 benchmarks/reference_model.py --family qwen2_moe --out /tmp/qwenref --minutes "${QWEN_MINUTES:-2.5}" \
    > "$out/logs/train-qwen.log" 2>&1
  tail -1 "$out/logs/train-qwen.log"
}

train_reference() {  # the Mixtral-format reference model (6 layers, 8 experts top-2) into /tmp/reference
  [ -f /tmp/reference/config.json ] && return
  timeout 200 python3 benchmarks/reference_model.py --out /tmp/reference --minutes 1.5 > "$out/logs/train-ref.log" 2>&1
  tail -1 "$out/logs/train-ref.log"
}

qwen_bench() {  # NAME ARGS...: specter against ondemand on the trained Qwen shape, one process
  local name=$1; shift
  timeout 100 python3 -m specter.bench --model /tmp/qwenref --max-new-tokens 64 --no-progress --no-plots --no-hf \
    --copy-gaps --systems ondemand,specter "$@" --out "$out/$name" > "$out/logs/$name.log" 2>&1
  echo "$name rc=$?"; grep -E "\| (ondemand|specter) \|" "$out/$name/results.md" | cut -d"|" -f3-8
}

gpu_tests() {  # table "GPU tests": every gpu-marked test (but the widening's: target gpu-widen, a call of its own), then
  # the exactness property test on CUDA
  timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider -o faulthandler_timeout=120 --ignore=tests/test_gpu_widen.py \
    > "$out/logs/gpu-tests.log" 2>&1
  tail -1 "$out/logs/gpu-tests.log"
  SPECTER_TEST_DEVICE=cuda SPECTER_TEST_EXAMPLES=6 timeout 140 python3 -m pytest -q -x tests/test_speculative.py \
    -p no:cacheprovider > "$out/logs/spec-cuda.log" 2>&1
  tail -1 "$out/logs/spec-cuda.log"
}

qwen() {  # table "Trained Qwen1.5-MoE shape": PROCESSES separate processes at Gen5 (default 2), one at Gen4
  train_qwen
  for i in $(seq 1 "${PROCESSES:-2}"); do qwen_bench "figs$i" --repeats 3 --residents 15,8 --link native; done
  qwen_bench gen4 --repeats 2 --residents 15 --link gen4
}

qwen_traces() {  # tables "Trained Qwen1.5-MoE shape" (one more process) and "Routing traces": traces, then figures
  train_qwen
  timeout 150 python3 benchmarks/record_traces.py --model /tmp/qwenref --residents 15,8 --out "$out/traces" \
    > "$out/logs/traces.log" 2>&1
  echo "traces rc=$?"
  qwen_bench figs --repeats 3 --residents 15,8 --link native
}

replay() {  # table "Routing traces", on the CPU: every policy pair and the offline bound over the traces
  local traces=${TRACES:-benchmarks/results/h200-2026-11-30/sixteenth/trace16/traces}
  for r in 15 8; do python -m specter.replay "$traces/trace-r$r.jsonl" --link 55 | tee "$out/replay-r$r.txt"; done
}

draft_step() {  # table "Draft step": the graphed int4 draft step against its HBM floor, Qwen (24 layers) and OLMoE (8)
  timeout 200 python3 benchmarks/graphed_tpot.py --draft-only --out "$out/graphed" > "$out/logs/graphed.log" 2>&1
  tail -4 "$out/logs/graphed.log"
  timeout 150 python3 benchmarks/graphed_tpot.py --draft-only --shape olmoe-1b-7b --layers 8 --out "$out/graphed-olmoe" \
    > "$out/logs/graphed-olmoe.log" 2>&1
  tail -3 "$out/logs/graphed-olmoe.log"
}

floor() {  # table "Resident decoding": full-depth resident TPOT against the HBM floor, three families
  timeout 300 python3 benchmarks/resident_floor.py --out "$out/floor" 2>&1 | tail -6
}

exact_rowwise() {  # the A/B for tuning.kernels.exact_rowwise (off until this has run): resident decoding without and
  # with it, alternating, for SHAPES (default Qwen1.5-MoE and DeepSeek-V2-Lite), one profiled full-depth k = 0 request
  # per side (engine_ab.py: GPU self time, kernels by time and count), then the GPU tests with it on in what is left of
  # the call's 10 minutes (the figures first: they decide whether the tests matter)
  local shape side
  for shape in ${SHAPES:-qwen1.5-moe-a2.7b deepseek-v2-lite}; do
    for side in off on off on; do
      timeout 120 python3 benchmarks/resident_floor.py --shape "$shape" --out "$out/exact-rowwise/$shape-$side" \
        $([ $side = on ] && echo --tune kernels.exact_rowwise=true) 2>&1 | tail -1 | sed "s/^/$side /"
    done
  done
  for side in off on; do
    timeout 150 python3 benchmarks/engine_ab.py "rowwise-$side" "$out/exact-rowwise/profile" --layers 24 --residents 60 \
      --configs k0 --requests 3 --new-tokens 32 $([ $side = on ] && echo --tune kernels.exact_rowwise=true) 2>&1 \
      | grep -E "^rowwise-"
  done
  local left=$((585 - SECONDS))
  [ "$left" -gt 60 ] || { echo "gpu tests (rowwise): ${left}s left, not run"; return; }
  timeout "$left" python3 -m pytest -q -p no:cacheprovider tests/test_gpu_graphed.py tests/test_gpu_graphed_mla.py \
    tests/test_exact_rowwise.py -m gpu -k rowwise > "$out/logs/gpu-rowwise.log" 2>&1
  echo "gpu tests (rowwise) rc=$? at ${SECONDS}s: $(tail -1 "$out/logs/gpu-rowwise.log")"
}

resident_hf() {  # table "Resident decoding", transformers row: transformers' generate on the same shape
  timeout 400 python3 benchmarks/resident_tpot.py --out "$out/resident" 2>&1 | tail -6
}

transfer() {  # table "Transfer engine and microkernel"
  timeout 200 python3 benchmarks/transfer_bench.py --out "$out/transfer" 2>&1 | tail -20
}

kernels() {  # table "Kernels": the draft step's row kernels alone, and the draft's fused MoE kernel
  timeout 240 python3 benchmarks/row_kernels_bench.py --out "$out/row-kernels" > "$out/logs/row-kernels.log" 2>&1
  tail -12 "$out/logs/row-kernels.log"
  timeout 150 python3 benchmarks/moe_kernel_bench.py --repeats 40 --shapes qwen1.5-moe-a2.7b --out "$out/moe" 2>&1 | tail -8
  timeout 150 python3 benchmarks/moe_kernel_bench.py --quick --repeats 50 --shapes mixtral-8x7b --out "$out/moe-mixtral" \
    2>&1 | tail -6
}

reference() {  # table "Mixtral-format reference model": every baseline, three links, 128 tokens
  train_reference
  timeout 380 python3 -m specter.bench --model /tmp/reference --residents 4,2 --link native,gen4,ddr4-desktop \
    --max-new-tokens 128 --systems resident,ondemand,specmoeoff,specter,specter-fixed,exact-prefetch,exact-prefetch-k0,exact-prefetch-specter \
    --time-budget 290 --no-progress --no-plots --out "$out/reference-full" 2>&1 | tail -50
}

reference_overlap() {  # table "Mixtral-format reference model", the draft-ahead: specter-serial against specter
  train_reference
  timeout 200 python3 -m specter.bench --model /tmp/reference --residents 4,2 --link native,gen4 --max-new-tokens 64 \
    --systems ondemand,specter-serial,specter --time-budget 140 --no-progress --no-plots --no-hf \
    --out "$out/reference-overlap" 2>&1 | tail -16
}

paper() {  # SHAPE: table "The paper's shapes, random weights": one shape per call, 8 layers, three links
  timeout 570 python3 -m specter.bench --model "$1" --preset paper --layers 8 --link native,gen4,ddr4-desktop \
    --max-new-tokens 64 --systems resident,ondemand,specmoeoff,specter,exact-prefetch-specter --time-budget 530 --no-progress \
    --no-plots --out "$out/paper-$1" 2>&1 | tail -35
}

paper_merge() {  # on the development machine, after the three paper calls' outputs were copied under $out
  python -m specter.bench --merge "$out/paper-qwen1.5-moe-a2.7b" --merge "$out/paper-deepseek-v2-lite" \
    --merge "$out/paper-phi-3.5-moe" --out "$out/paper-3links"
}

serve() {  # table "Serving": specter serve under 1, 4 and 16 concurrent clients on the trained Qwen shape
  train_qwen
  timeout 240 python3 benchmarks/serve_load.py --model /tmp/qwenref --residents 15 --max-tokens 64 --requests 2 \
    --concurrency 1 4 16 --out "$out/serve_load.json" > "$out/logs/serve-load.log" 2>&1
  echo "serve load rc=$?"; tail -6 "$out/logs/serve-load.log"
}

before_after() {  # ROUNDS: the same bench on the code in $OLD (`git archive REV specter policies backends pyproject.toml |
  # tar -x -C .old`, carried) and on this tree, one trained model, Gen5 and Gen4 in each process; processes alternate
  # old new new old ... so drift on the shared machine falls on both sides, and the table takes each cell's median;
  # AB_RESIDENTS, AB_LINKS, AB_SYSTEMS narrow the matrix to the cells in question. AB_VARIANTS (default "old new"):
  # more sides, each TREE or TREE+NAME=BENCH-ARGS with commas for spaces, e.g. "old old+t1=--threads,1 new
  # new+t16=--threads,16"; the table compares each with the first
  local variant side label extra dir round order
  local variants=${AB_VARIANTS:-old new}
  for variant in $variants; do
    case ${variant%%[+=]*} in old|new) ;; *) echo "AB_VARIANTS: '$variant' names no tree (old or new)" >&2; return 2 ;; esac
  done
  train_qwen
  for round in $(seq 1 "$1"); do
    order=$variants; [ $((round % 2)) = 0 ] && order=$(echo $variants | tr ' ' '\n' | tac | tr '\n' ' ')
    for variant in $order; do
      side=${variant%%[+=]*}; label=${variant%%=*}; extra=; [ "$variant" != "${variant#*=}" ] && extra=${variant#*=}
      dir=$PWD; [ $side = old ] && dir=${OLD:-$PWD/.old}
      (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout "${AB_TIMEOUT:-120}" python3 -m specter.bench --model /tmp/qwenref \
        --max-new-tokens 64 --no-progress --no-plots --no-hf --repeats 1 --residents "${AB_RESIDENTS:-15,8}" \
        --link "${AB_LINKS:-native,gen4}" --systems "${AB_SYSTEMS:-ondemand,specter}" ${extra//,/ } \
        --out "$out/ab-$label-$round" > "$out/logs/ab-$label-$round.log" 2>&1
       echo "$label round $round rc=$?")
    done
  done
  python3 - "$out" $variants <<'PY'
import json, pathlib, statistics, sys
labels = [v.split("=")[0] for v in sys.argv[2:]]
cells = {}
for path in sorted(pathlib.Path(sys.argv[1]).glob("ab-*-*/results.json")):
    label = path.parent.name[3:].rsplit("-", 1)[0]
    for r in json.loads(path.read_text())["summary"]:
        key = (r["link"], r["setting"], r["system"])
        cells.setdefault(key, {}).setdefault(label, []).append((r["tpot_ms"], r.get("h2d_decode_mb_per_token", r["h2d_mb_per_token"]), r["tokens_equal"]))
first = labels[0]
print(f"| link | residents | system | side | TPOT (median) | / {first} | decode MB/tok | runs | tokens equal |")
print("|---|---|---|---|---|---|---|---|---|")
for (link, setting, system), sides in sorted(cells.items()):
    if first not in sides:
        continue
    base = statistics.median(t for t, _, _ in sides[first])
    for label in labels:
        if label not in sides:
            continue
        runs = sides[label]
        tpot = statistics.median(t for t, _, _ in runs)
        mb = statistics.median(m for _, m, _ in runs)
        print(f"| {link} | {setting} | {system} | {label} | {tpot:.2f} | {tpot / base:.3f} | {mb:.1f} | {len(runs)} | "
              f"{all(e for _, _, e in runs)} |")
PY
}

old_tree() {  # TARGET: the old tree's absolute path ($OLD, default .old: `git archive REV specter policies backends
  # pyproject.toml | tar -x -C .old`, carried); where it holds no specter, says so for TARGET and fails
  local old
  old=$(cd "${OLD:-$PWD/.old}" 2>/dev/null && pwd) && [ -d "$old/specter" ] || { echo "$1: no old tree at ${OLD:-.old}" >&2; return 1; }
  echo "$old"
}

engine_ab() {  # a change's A/B on the engine alone: benchmarks/engine_ab.py (no bench harness) in the trees of $OLD and
  # of this one, alternating old new new old, synthetic Qwen shape (8 layers)
  local side dir here=$PWD dest=$out/engine-ab n=0 old
  old=$(old_tree engine-ab) || return 1
  mkdir -p "$dest"
  for side in old new new old; do  # from /tmp, so that only $dir's specter is importable
    n=$((n + 1)); dir=$here; [ $side = old ] && dir=$old
    (cd /tmp && PYTHONPATH=/tmp/site:$dir timeout "${AB_TIMEOUT:-100}" python3 "$here/benchmarks/engine_ab.py" $side "$dest" \
      --configs "${AB_CONFIGS:-default,fixed8}" > "$dest/$side-$n.log" 2>&1
     echo "$side $n rc=$?"; grep -E "^(old|new) " "$dest/$side-$n.log")
  done
}

realism() {  # table "Full-depth narrow checkpoints: realism": SHAPES (default: five) trained at once, then their reports
  local shapes=${SHAPES:-"qwen1.5-moe-a2.7b deepseek-v2-lite qwen3-30b-a3b phi-3.5-moe mixtral-8x7b"} s
  mkdir -p "$out/realism"
  for s in $shapes; do  # batch 12: five at batch 32 would need about 240 GB of GPU memory
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 330 python3 benchmarks/reference_model.py --shape $s \
      --minutes "${MINUTES:-3}" --batch 12 --reuse --out /tmp/narrow/$s > "$out/realism/train-$s.log" 2>&1 &
  done
  wait
  for s in $shapes; do
    timeout 200 python3 -m specter.bench.realism --model /tmp/narrow/$s --json "$out/realism/$s.json" \
      > "$out/realism/realism-$s.log" 2>&1 &
  done
  wait
  grep -h "^trained\|^held-out\|^FLAG" "$out"/realism/*.log
}

host_expert() {  # table "Host expert path": one routed expert of each shape on the host (SHAPES, default all five),
  # 1 and 16 rows at 8 and 15 threads, cold: the host path against the same F.linear chain inline, the left-operand
  # form and prepacked weights, then the parallel modes (one-thread workers per expert; one expert split over them) against one team per expert,
  # then a layer of 16 experts through the native kernel one call per expert against one call for the layer.
  # About 20-100 s a shape (Mixtral's pools of 15 and 16 experts are 5.3 and 5.6 GB pinned).
  mkdir -p "$out/host-expert"
  local shape
  for shape in ${SHAPES:-qwen1.5-moe-a2.7b deepseek-v2-lite qwen3-30b-a3b phi-3.5-moe mixtral-8x7b}; do
    timeout 200 python3 benchmarks/host_expert.py "$shape" 1,16 8,15 20 3 - 1 > "$out/host-expert/host-$shape.log" 2>&1
    echo "host-expert $shape rc=$? at ${SECONDS}s"; grep -v '^\[' "$out/host-expert/host-$shape.log" | cut -c1-220
  done
}

host_job() {  # "What is not measured yet": a host job's fixed cost (benchmarks/host_job_cost.py), one expert shape (SHAPE,
  # default qwen1.5-moe-a2.7b) at 15 threads, jobs after idle gaps of 0, 0.5 and 2 ms, cold weights; then the same under
  # OMP_WAIT_POLICY=active (libgomp reads it at start: a process of its own), which keeps the team spinning between jobs;
  # then the job as the engine runs it (--layer: HostExperts.compute_layer). About 40 s each.
  mkdir -p "$out/host-job"
  local policy
  for policy in default active; do
    if [ "$policy" = active ]; then set -- env OMP_WAIT_POLICY=active; else set -- env -u OMP_WAIT_POLICY; fi
    "$@" timeout 150 python3 benchmarks/host_job_cost.py "${SHAPE:-qwen1.5-moe-a2.7b}" 15 0,0.5,2 30 \
      > "$out/host-job/host-job-$policy.log" 2>&1
    echo "host-job $policy rc=$? at ${SECONDS}s"; grep fixed "$out/host-job/host-job-$policy.log"
  done
  timeout 150 python3 benchmarks/host_job_cost.py "${SHAPE:-qwen1.5-moe-a2.7b}" 15 0,2 30 --layer \
    > "$out/host-job/host-job-layer.log" 2>&1  # the job as the engine runs it: the kernel and the Python around it
  echo "host-job layer rc=$? at ${SECONDS}s"; grep fixed "$out/host-job/host-job-layer.log"
}

host_job_ab() {  # table "A host job's cost around its kernel", the kernel's change: the kernel alone
  # (benchmarks/host_job_cost.py: SHAPE, default mixtral-8x7b, 15 threads, cold, back to back, REPEATS rounds) in the
  # tree of $OLD (`git archive REV specter policies backends pyproject.toml | tar -x -C .old`, carried) and in this one,
  # alternating old new new old, each side's kernel built into a cache of its own; POLICY=active runs all four under
  # OMP_WAIT_POLICY=active. About 40-60 s a process on Mixtral's experts.
  local old here=$PWD side n=0 dest=$out/host-job-ab
  old=$(old_tree host-job-ab) || return 1
  mkdir -p "$dest"
  for side in old new new old; do  # from /tmp, so that only the side's own specter is importable
    n=$((n + 1)); dir=$here; [ $side = old ] && dir=$old
    (cd /tmp && SPECTER_CACHE=/tmp/specter-cache-$side PYTHONPATH=/tmp/site:$dir ${POLICY:+env OMP_WAIT_POLICY=$POLICY} \
      timeout 150 python3 "$here/benchmarks/host_job_cost.py" "${SHAPE:-mixtral-8x7b}" 15 0 "${REPEATS:-12}" \
      > "$dest/$side-$n.log" 2>&1
     echo "$side $n rc=$? at ${SECONDS}s"; grep fixed "$dest/$side-$n.log")
  done
}

hybrid() {  # issue 29 (no table yet): the hybrids beside the systems they extend, Mixtral-8x7B's shape (4 layers, random
            # weights) at 2 residents and Gen4; first one host expert's time, what auto's calibration measures at load.
            # PLACEMENT_OVERLAP=1: auto weighs the paths as overlapped and splits (4 of 6 non-residents per layer on
            # the host, the first run's placement), so that the host-path table's "host hidden" and "ms per host
            # expert" (against cpu-experts') measure how far the two paths overlap (default: auto's, which puts all 6)
  timeout 25 python3 benchmarks/host_expert.py mixtral-8x7b 16 16 3 2>&1 | head -1
  timeout 170 python3 -m specter.bench --model mixtral-8x7b --layers 4 --residents 2 --link gen4 --max-new-tokens 32 \
    --systems ondemand,specter,cpu-experts,ondemand-hybrid,specter-hybrid --time-budget 120 --no-progress --no-plots \
    ${PLACEMENT_OVERLAP:+--placement-overlap "$PLACEMENT_OVERLAP"} --no-hf --out "$out/hybrid" 2>&1 | tail -24
}

llamacpp() {  # issue 28 item 5, llama.cpp as a peer: build it with CUDA (timed), convert MODEL to GGUF BF16 with its own
  # converter, run it greedy on MODEL's prompts with -ngl 99 --n-cpu-moe N, N fitted to Specter's budget (BUDGET_GIB, or
  # RESIDENTS: what Specter's memory plan takes at that many slots; default RESIDENTS=15). MODEL: a checkpoint dir
  # (default /tmp/qwenref, trained on the GPU while the CPU compiles); WIDEN=F: MODEL is narrow, converted as its
  # widened model. Stage the sources first (python benchmarks/llamacpp.py stage --sdist ...) and carry .llama.cpp with
  # .whl. The build stays in /tmp/llama.cpp-build-cuda while the machine is warm: a call stopped by the deadline in the
  # build is resumed by the next. LLAMACPP_ONLY=build stops after the build; LLAMACPP_FA=off builds without the CUDA
  # flash-attention kernels (a quarter less compile time; attention runs without them); AGREE=1 then compares
  # llama.cpp's greedy tokens with Specter's (all experts resident, bf16, on the GPU).
  # SHAPE=NAME: the full-depth narrow checkpoint /tmp/narrow/NAME (fulldepth's) is trained on the GPU while the CPU
  # compiles, unless it is there already; it is then MODEL's default, converted widened (WIDEN, default: its factor).
  # The default GGUF is /tmp/llamacpp-gguf/MODEL-xF-TYPE.gguf; a conversion cut by the deadline leaves nothing behind.
  # Widened GGUFs beyond DeepSeek-V2-Lite's 28.5 GiB need the 2-GPU machine's disk: run there with CUDA_VISIBLE_DEVICES=0
  # (-ngl 99 would spread the layers over both GPUs, past the one-GPU budget).
  [ -d .llama.cpp ] || { echo "no .llama.cpp: python benchmarks/llamacpp.py stage --sdist ..., and carry it" >&2; return 1; }
  local model=${MODEL:-/tmp/qwenref} budget nofa= trainer= widen=${WIDEN:-}
  [ "${LLAMACPP_FA:-on}" = off ] && nofa=--no-fa-kernels
  if [ -n "${SHAPE:-}" ]; then
    model=${MODEL:-/tmp/narrow/$SHAPE}
    [ -n "$widen" ] || widen=$(python3 -c "import sys; from specter.bench.widen import DEFAULT_FACTORS as F; print(F[sys.argv[1]])" "$SHAPE") \
      || { echo "llamacpp: no widening factor for SHAPE=$SHAPE" >&2; return 1; }
    [ -f "$model/train.json" ] || { PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout "${TRAIN_TIMEOUT_S:-330}" python3 \
      benchmarks/reference_model.py --shape "$SHAPE" $(train_length) --batch 32 --reuse --out "$model" \
      >> "$out/logs/train-$SHAPE.log" 2>&1 & trainer=$!; }
  elif [ -z "${MODEL:-}" ] && [ "${LLAMACPP_ONLY:-}" != build ]; then
    train_qwen & trainer=$!
  fi
  python3 benchmarks/llamacpp.py build --cuda $nofa --deadline-s $((570 - SECONDS)) --log "$out/llamacpp/build.log" \
    >> "$out/logs/llamacpp.log" 2>&1
  echo "llamacpp build rc=$? at ${SECONDS}s"; tail -1 "$out/logs/llamacpp.log" | cut -c1-400
  [ -z "$trainer" ] || { wait "$trainer"; echo "training rc=$? at ${SECONDS}s"; }
  [ "${LLAMACPP_ONLY:-}" = build ] && return
  if [ -n "${BUDGET_GIB:-}" ]; then budget="--budget-gib $BUDGET_GIB"; else budget="--residents ${RESIDENTS:-15}"; fi
  df -h /tmp | tail -1
  python3 benchmarks/llamacpp.py all "$model" $budget $nofa ${widen:+--widen "$widen"} ${AGREE:+--agree --device cuda} \
    --deadline-s $((580 - SECONDS)) \
    --out "$out/llamacpp" >> "$out/logs/llamacpp.log" 2>&1
  echo "llamacpp rc=$? at ${SECONDS}s"; grep -E "^(disk|convert):|^agree|GiB, llama.cpp" "$out/logs/llamacpp.log" | cut -c1-400
}

llamacpp_matrix() {  # llama.cpp's cells beside a full-depth table: SHAPE's narrow checkpoint (/tmp/narrow/SHAPE) converted
  # widened once (its factor) and run at each budget of BUDGETS_GIB (default 24,16), greedy (with llama-bench) and sampled
  # (--temp 0.7 --top-p 0.9 -s 1), llama.cpp's default threads; THREADS8=1 adds greedy at -t 8 (the desktop's CPU) at
  # the first budget. Needs the build and the checkpoint on the warm machine: a call of `SHAPE=NAME LLAMACPP_ONLY=build
  # llamacpp` first (build and training in one call), then this target in the next. Carry .llama.cpp and .whl.
  # GGUF_DIR=/dev/shm converts into RAM instead of /tmp's disk: the one-GPU machine's disk (about 64 GiB free) holds
  # DeepSeek-V2-Lite's 28.5 GiB GGUF but not Qwen3-30B-A3B's 55.7, which its /dev/shm (half of its 128 GiB) does;
  # DROP_GGUF=1 then deletes it at the end, so that a later Specter call's pinned pool has the RAM back. GGUF_SPILL=DIR
  # (with GGUF_DIR=/dev/shm: a directory on the disk) writes the GGUF split, GGUF_ROOM_GIB of it in GGUF_DIR and the
  # rest in DIR: Phi-3.5-MoE's 77.5 GiB and Mixtral-8x7B's 86.5 GiB do not fit the disk, and /dev/shm, whose free space
  # is the machine's 128 GiB of memory, should not hold all of one (56 GiB of Qwen3's ran there).
  local shape=${SHAPE:?llamacpp-matrix needs SHAPE} model widen budget gguf=
  model=/tmp/narrow/$shape
  [ -f "$model/train.json" ] || { echo "llamacpp-matrix: no checkpoint at $model (run llamacpp with LLAMACPP_ONLY=build first)" >&2; return 1; }
  widen=$(python3 -c "import sys; from specter.bench.widen import DEFAULT_FACTORS as F; print(F[sys.argv[1]])" "$shape") || return 1
  [ -z "${GGUF_DIR:-}" ] || gguf=$GGUF_DIR/$shape-x$widen-bf16.gguf
  [ -z "${GGUF_SPILL:-}" ] || [ -n "$gguf" ] || { echo "llamacpp-matrix: GGUF_SPILL needs GGUF_DIR (whose GGUF DROP_GGUF drops)" >&2; return 1; }
  local first=1
  for budget in ${BUDGETS_GIB:-24 16}; do
    for mode in greedy sampled threads8; do
      [ "$mode" = threads8 ] && { [ -n "${THREADS8:-}" ] && [ "$first" = 1 ] || continue; }
      local left=$((585 - SECONDS)) extra=()
      [ "$left" -gt 60 ] || { echo "llamacpp-matrix: ${left}s left, stopping before $budget GiB $mode"; break 2; }
      case "$mode" in
        greedy) extra=() ;;
        sampled) extra=(--no-bench --extra-args "--temp 0.7 --top-p 0.9 -s 1") ;;
        threads8) extra=(--no-bench --threads 8) ;;
      esac
      python3 benchmarks/llamacpp.py all "$model" --budget-gib "$budget" --widen "$widen" --label "$shape-x$widen-${budget}GiB-$mode" \
        "${extra[@]}" ${gguf:+--gguf "$gguf"} ${GGUF_SPILL:+--spill "$GGUF_SPILL"} ${GGUF_ROOM_GIB:+--room-gib "$GGUF_ROOM_GIB"} --deadline-s "$((left - 5))" \
        --out "$out/llamacpp" >> "$out/logs/llamacpp.log" 2>&1
      echo "llamacpp $budget GiB $mode rc=$? at ${SECONDS}s"; grep -E "^$shape-x$widen-${budget}GiB-$mode:" "$out/logs/llamacpp.log" | tail -1 | cut -c1-400
    done
    first=0
  done
  [ -z "$gguf" ] || [ -z "${DROP_GGUF:-}" ] || { python3 benchmarks/llamacpp.py drop "$gguf" | cut -c1-300; }
}

train_length() {  # a full-depth narrow training's length: MINUTES (default 3), or STEPS steps (the same seeds, data
  # order and learning rate each step: calls on fresh machines train the same model, up to the GPU's non-deterministic
  # sums, so their cells compare; the minutes then only cap it, at 3.5, so that training and the save end within the
  # 330 s timeout (TRAIN_TIMEOUT_S) and leave the bench its time: choose STEPS to end well inside that, about 140 for
  # Qwen3-30B-A3B). RECOMPUTE_LAYERS=N: the first N layers recompute their activations in the backward pass, the same
  # weights in less GPU memory (Qwen3-30B-A3B's training peaks at 91 GiB: N = 24 on an H100, with MINUTES and
  # TRAIN_TIMEOUT_S raised for the recomputation's time and a slower card, the call then only training)
  if [ -n "${STEPS:-}" ]; then echo "--max-steps $STEPS --minutes ${MINUTES:-3.5}"; else echo "--minutes ${MINUTES:-3}"; fi
  [ -z "${RECOMPUTE_LAYERS:-}" ] || echo "--recompute-layers $RECOMPUTE_LAYERS"
}

placement_trace() {  # DIR TRACE LOG: record a routing trace of the checkpoint DIR (reference_model.py --shape's) to TRACE
  # and print its path, or print nothing (and say why on stderr) when none was recorded. Prompt: the first 64 bytes of
  # the first held-out window (held_out.json) that holds none of the bench's measured prompts (prompts.json), so the
  # bench is not placed from the text it measures. Offloaded (a trace records the verify of offloaded rounds) at
  # max(top-k, experts / 4) slots, speculating at depth TRACE_K (default 15, the bench's k_max: its `specter` rounds in
  # the link-bound full-depth cells drafted that deep, and the cost model charges a speculating engine's host expert
  # once per round, so a trace of shorter rounds prices the host path at several times its cost), sampled as the
  # bench's sampled requests are (temperature 0.7, top-p 0.9): a trained narrow model's greedy text can loop, and a
  # loop's routing reuses experts more than the bench's text does.
  local dir=$1 trace=$2 log=$3 inputs
  rm -f "$trace"  # a stale trace of an earlier call must not stand in for this one
  # A warm machine's earlier call recorded it already for this checkpoint (newer than its train.json) and settings:
  # kept beside the checkpoint's directory (not in it: the converters and loaders read that)
  local kept="${dir%/}.placement-trace-k${TRACE_K:-15}-t${TRACE_TOKENS:-256}.jsonl"
  if [ -s "$kept" ] && [ "$kept" -nt "$dir/train.json" ]; then
    cp "$kept" "$trace" && echo "placement trace: kept from an earlier call on this checkpoint ($kept)" >&2 && echo "$trace"
    return
  fi
  inputs=$(python3 -c 'import json, sys; from pathlib import Path; from specter.model.checkpoint import Checkpoint
d = Path(sys.argv[1]); spec = Checkpoint(d).spec
measured = [bytes(ids) for kind in json.loads((d / "prompts.json").read_text())["kinds"].values() for ids in kind]
window = next(w for w in json.loads((d / "held_out.json").read_text())["windows"] if not any(m in bytes(w) for m in measured))
print(max(spec.top_k, spec.num_experts // 4), ",".join(map(str, window[:64])))' "$dir" 2>"$log") \
    || { echo "placement trace: no held-out prompt from $dir (see $log); the bench places without a trace" >&2; return; }
  timeout 90 python3 -m specter generate --model "$dir" --residents "${inputs%% *}" --prompt-ids "${inputs#* }" \
    --max-new-tokens "${TRACE_TOKENS:-256}" --k "${TRACE_K:-15}" --temperature 0.7 --top-p 0.9 --json --trace "$trace" >> "$log" 2>&1
  local rc=$? lines
  echo "placement trace rc=$rc at ${SECONDS}s: $(tail -1 "$log" | cut -c1-200)" >&2
  lines=$(grep -c . "$trace" 2>/dev/null)
  # a generate cut by its timeout may leave a torn last line, which the bench would refuse (and so not run at all)
  if [ "$rc" -eq 0 ] && [ "${lines:-0}" -gt 1 ]; then cp "$trace" "$kept"; echo "$trace"
  else echo "placement trace: none recorded (rc=$rc, ${lines:-0} lines); the bench places without a trace" >&2; fi
}

run_cmd() {  # target cmd: CMD, a shell command, in the GPU machine's set-up environment (the staged wheels, the project,
  # SPECTER_CACHE), for the one-off commands docs/BENCHMARKS.md states (a profile, a bench with its own options); its
  # output to the terminal and $out/logs/cmd.log. Another target only for its set-up would run that target too.
  bash -c "${CMD:?target cmd needs CMD, the command to run}" 2>&1 | tee -a "$out/logs/cmd.log"
  local rc=${PIPESTATUS[0]}
  echo "cmd rc=$rc"
  return "$rc"
}

fulldepth_prepare() {  # fulldepth's steps before its bench, alone as target fulldepth-prepare: SHAPE's narrow checkpoint
  # (trained unless there), its realism report and its placement trace (kept beside the checkpoint, so that the next
  # fulldepth call on the warm machine spends its 10 minutes on the bench). Sets profile (the trace's path, or empty).
  local shape=${SHAPE:-qwen1.5-moe-a2.7b}
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout "${TRAIN_TIMEOUT_S:-330}" python3 benchmarks/reference_model.py \
    --shape "$shape" $(train_length) --batch 32 --reuse --out "/tmp/narrow/$shape" >> "$out/logs/train-$shape.log" 2>&1
  echo "train $shape rc=$? at ${SECONDS}s"; grep -h "^trained\|already holds\|holds a run of other settings" "$out/logs/train-$shape.log"
  mkdir -p "$out/fulldepth-$shape"  # the checkpoint's realism report, on the narrow model (its function, seconds)
  [ -n "${NO_REALISM:-}" ] || { timeout 150 python3 -m specter.bench.realism --model "/tmp/narrow/$shape" \
    --json "$out/fulldepth-$shape/realism.json" > "$out/logs/realism-$shape.log" 2>&1
    echo "realism $shape rc=$? at ${SECONDS}s"; grep -h "^held-out\|^FLAG" "$out/logs/realism-$shape.log"; }
  [ -n "${NO_TRACE:-}" ] || profile=$(placement_trace "/tmp/narrow/$shape" "$out/fulldepth-$shape/placement-trace.jsonl" \
    "$out/logs/trace-$shape.log")
}

fulldepth() {  # table "Full-depth Qwen1.5-MoE-A2.7B shape" (one per shape): SHAPE (default qwen1.5-moe-a2.7b) at full depth and the real dims: trained
  # narrow alone for MINUTES (default 3) or STEPS (train_length) at batch 32 (five at once needed batch 12, one alone fits 32) into
  # /tmp/narrow/SHAPE (--reuse: a second call on the warm machine skips training), then the bench on it widened
  # (--widen auto: F from its train.json) over BUDGETS x LINKS x SYSTEMS, greedy and sampled, cut to the call's 10
  # minutes. Phi-3.5-MoE and Mixtral-8x7B default to larger BUDGETS: their int4 draft alone is 19.3 and 21.7 GiB
  # (minimum budgets 31.4 and 45.3 GiB). `resident` (25.7 to 86.7 GiB of GPU memory: it fits for all five) costs one
  # more widened load of every expert; add it to SYSTEMS in a call of its own. Narrow LINKS, SYSTEMS or BUDGETS per
  # call and --merge the outputs where one call does not hold the matrix (the first call on a fresh machine trains;
  # the merge compares only systems one call ran together, so split LINKS or BUDGETS before SYSTEMS).
  # The narrow checkpoint's realism report goes to fulldepth-SHAPE/realism.json first (NO_REALISM=1 skips it).
  # Then a routing trace of the narrow checkpoint (its routing is the widened model's), fulldepth-SHAPE/placement-trace.jsonl
  # (placement_trace), goes to the bench as --placement-profile: without one auto cannot price a speculating engine's
  # misses and places specter-hybrid off (it had put all on the host, 1.8x slower than specter). NO_TRACE=1 skips it
  # (specter-hybrid then runs as specter, ondemand-hybrid from uniform routing); TRACE_TOKENS (default 256) sets its length. BENCH_ARGS: more bench
  # options, word-split (e.g. "--tune host.parallel_experts=true --repeats 2"). Each cell warms up on 64 tokens: the
  # governor's estimates start afresh with each cell, and after the bench's default 16 the first measured prompt
  # still climbed from the acceptance prior (docs/BENCHMARKS.md, "What is not measured yet").
  local shape=${SHAPE:-qwen1.5-moe-a2.7b} budgets profile=
  fulldepth_prepare
  local left=$((585 - SECONDS))  # the call's 10 minutes count from this script's start (other targets may run first)
  case "$shape" in
    phi-3.5-moe) budgets=${BUDGETS:-48GiB,36GiB} ;;
    mixtral-8x7b) budgets=${BUDGETS:-64GiB,48GiB} ;;
    qwen3-30b-a3b) budgets=${BUDGETS:-36GiB,24GiB} ;;  # its minimum is 20.6 GiB (13.9 of int4 draft): 16 is refused
    *) budgets=${BUDGETS:-24GiB,16GiB} ;;
  esac
  [ "$left" -gt 120 ] || { echo "fulldepth $shape: ${left}s left in this call, too little for a widened load; run it first"; return; }
  timeout -k 15 "$left" python3 -m specter.bench --model "/tmp/narrow/$shape" --widen auto --budget "$budgets" \
    --link "${LINKS:-native,gen4,ddr4-desktop}" --sampling greedy,sampled --max-new-tokens 64 \
    --systems "${SYSTEMS:-ondemand,specmoeoff,cpu-experts,specter,specter-hybrid,exact-prefetch-specter}" \
    --time-budget $((left - 65)) --warmup-tokens 64 --no-progress --no-plots --no-hf \
    ${profile:+--placement-profile "$profile"} ${BENCH_ARGS:-} \
    --out "$out/fulldepth-$shape" > "$out/logs/fulldepth-$shape.log" 2>&1
  echo "fulldepth $shape rc=$? at ${SECONDS}s"; tail -40 "$out/logs/fulldepth-$shape.log"
}

cpu_quick() {  # table "CPU quick matrix": the default matrix on the built-in tiny model, on the CPU
  python -m specter.bench --no-progress --no-plots --out "$out/cpu-quick" | tail -20
}

[ $# -gt 0 ] || { sed -n 2,9p "$0"; exit 2; }
for target in "$@"; do
  case "$target" in
    replay|cpu-quick|paper-merge) ;;
    *) [ -n "${GPU_READY:-}" ] || { gpu_setup; GPU_READY=1; } ;;
  esac
  case "$target" in
    gpu-tests) gpu_tests ;;
    gpu-widen) gpu_widen ;;
    qwen) qwen ;;
    qwen-traces) qwen_traces ;;
    replay) replay ;;
    draft-step) draft_step ;;
    floor) floor ;;
    resident-hf) resident_hf ;;
    transfer) transfer ;;
    kernels) kernels ;;
    reference) reference ;;
    reference-overlap) reference_overlap ;;
    paper-qwen) paper qwen1.5-moe-a2.7b ;;
    paper-deepseek) paper deepseek-v2-lite ;;
    paper-phi) paper phi-3.5-moe ;;
    paper-merge) paper_merge ;;
    cpu-quick) cpu_quick ;;
    serve) serve ;;
    before-after) before_after "${ROUNDS:-2}" ;;
    engine-ab) engine_ab ;;
    realism) realism ;;
    hybrid) hybrid ;;
    llamacpp) llamacpp ;;
    llamacpp-matrix) llamacpp_matrix ;;
    fulldepth) fulldepth ;;
    fulldepth-prepare) fulldepth_prepare ;;
    cmd) run_cmd ;;
    host-expert) host_expert ;;
    host-job) host_job ;;
    host-job-ab) host_job_ab ;;
    exact-rowwise) exact_rowwise ;;
    *) echo "unknown target: $target" >&2; exit 2 ;;
  esac
done
