# curl (and wget) as a grader's test.sh finds it in a sandbox: offline. Harbor's test.sh template fetches uv's installer
# (`curl -LsSf https://astral.sh/uv/<version>/install.sh | sh`, then `source $HOME/.local/bin/env`); in a sandbox
# `uv` and `uvx` are sandforge's offline stand-ins already (uv.sh), so that installer is not fetched: what comes back
# is a script that leaves the files it would have left ($HOME/.local/bin/env, and $HOME/.cargo/env of older uv
# installers), empty. Any other URL goes to the image's own curl or wget, which fails offline as it would.
#   bash curl.sh curl ARGS...   or   bash curl.sh wget ARGS...
set -u
tool=${1:?}; shift
installer= output=
args=("$@")
while (($#)); do
  case $1 in
    https://astral.sh/uv/install.sh|https://astral.sh/uv/*/install.sh|http://astral.sh/uv/*install.sh) installer=$1 ;;
    -o|--output|-O|--output-document) output=${2:-}; shift ;;
    --output=*|--output-document=*) output=${1#*=} ;;
  esac
  shift
done
if [[ -z $installer ]]; then
  real=$(type -P "$tool") || {
    echo "$tool (sandforge, offline): $tool is not installed in the image, and sandboxes have no network" >&2
    exit 127
  }
  exec "$real" "${args[@]}"
fi
script='mkdir -p "$HOME/.local/bin" "$HOME/.cargo" && : > "$HOME/.local/bin/env" && : > "$HOME/.cargo/env"
echo "uv (sandforge, offline): the uv installer is not fetched; uv and uvx are sandforge'"'"'s offline stand-ins" >&2
'
echo "$tool (sandforge, offline): $installer is not fetched (uv and uvx are sandforge's offline stand-ins)" >&2
if [[ -n $output && $output != - ]]; then printf '%s' "$script" > "$output"; else printf '%s' "$script"; fi
