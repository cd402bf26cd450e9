# uv as a grader's test.sh finds it in a sandbox: offline, and making nothing from what the policy left
# (sandforge/grading/startup.py). terminal-bench's test.sh runs `uv venv .tbench-testing`, sources its activate, then
# `uv pip install pytest==8.4.1` and `uv run pytest ...`: the venv is made afresh here (what stood at that path is
# removed first, so a planted activate never runs), it sees the image's packages, an install succeeds only for what
# the image already has, and `uv run` runs the command.
#   bash uv.sh uv ARGS...   or   bash uv.sh uvx ARGS...
set -u
say() { echo "uv (sandforge, offline): $*" >&2; }
die() { say "$*"; exit 2; }
# a venv that cannot be made where the caller expects one: what stands at that path may be the policy's, and the
# caller would source its activate next; so the caller (test.sh's shell) is stopped too, and scores no reward
refuse() { say "$*; the venv is not made, and the script that asked for it is stopped"; kill -TERM "$PPID"; exit 2; }

# version of each requirement that is installed, or "missing"; exit 1 if any is missing
check_installed() {
  local specs=() line
  while (($#)); do
    case $1 in
      -r|--requirement) while IFS= read -r line; do line=${line%%#*}; [[ $line =~ [^[:space:]] ]] && specs+=("$line")
                        done < "$2" || return 2; shift 2 ;;
      --requirement=*) set -- --requirement "${1#*=}" "${@:2}" ;;
      -i|--index-url|--extra-index-url|-f|--find-links|-c|--constraint|--override|-p|--python|--target|--prefix)
        shift 2 ;;
      -e|--editable) say "cannot install $2 (an editable install needs the build tools and maybe the network)"
                     return 1 ;;
      -*) shift ;;
      *) specs+=("$1"); shift ;;
    esac
  done
  ((${#specs[@]})) || return 0
  python3 -I - "${specs[@]}" <<'EOF'
import importlib.metadata as metadata, re, sys
missing = []
for spec in sys.argv[1:]:
    found = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*)", spec)
    if not found:
        missing.append(spec)
        continue
    name, wanted = found.group(1), found.group(3).split(";")[0].strip()
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        missing.append(spec)
        continue
    pin = re.fullmatch(r"==\s*([^\s,]+)", wanted)
    note = f" (asked for {wanted})" if wanted and not (pin and pin.group(1) == have) else ""
    print(f"uv (sandforge, offline): {name} {have} is installed{note}", file=sys.stderr)
if missing:
    print("uv (sandforge, offline): not installed, and sandboxes have no network: " + ", ".join(missing)
          + " (install it in the task's image: environment/Dockerfile)", file=sys.stderr)
    sys.exit(1)
EOF
}

# uv's global options before the subcommand
skip_global() {
  while (($#)); do
    case $1 in
      --cache-dir|--directory|--project|--color|--config-file|--python-preference) shift 2 ;;
      -*) shift ;;
      *) break ;;
    esac
  done
  printf '%s\0' "$@"
}

tool=${1:?}; shift
if [[ $tool == uvx ]]; then  # uvx is `uv tool run`: every option it takes is that command's
  set -- tool run "$@"
else
  mapfile -d '' args < <(skip_global "$@")
  set -- "${args[@]}"
fi
command=${1:-}; shift || true

case $command in
  --version|-V|version) echo "uv 0.0.0 (sandforge's offline stand-in)" ;;
  venv)
    path=
    while (($#)); do
      case $1 in
        -p|--python|--prompt|-i|--index-url|--extra-index-url|-f|--find-links|--link-mode|--exclude-newer|--index|\
        --default-index|--index-strategy|--keyring-provider|--python-preference|--cache-dir|--directory|--project|\
        --color|--config-file) (($# >= 2)) || die "$1 needs a value"; shift 2 ;;
        --*=*|--seed|--clear|--allow-existing|--system-site-packages|--relocatable|--no-project|-q|--quiet|-v|\
        --verbose|--no-cache|--offline|--native-tls|--no-progress|--no-config|--no-python-downloads) shift ;;
        -*) refuse "uv venv $1: an option this offline stand-in does not know" ;;
        *) [[ -z $path ]] || refuse "uv venv: one path only (got $path and $1)"; path=$1; shift ;;
      esac
    done
    path=${path:-.venv}
    rm -rf -- "$path" || die "cannot remove what stands at $path"
    python3 -I -m venv --system-site-packages --without-pip "$path" || die "cannot make a venv at $path"
    say "made $path (it sees the image's packages)" ;;
  pip)
    sub=${1:-}; shift || true
    case $sub in
      install|sync) check_installed "$@" ;;
      list|freeze|show) exec python3 -I -m pip "$sub" "$@" ;;
      *) say "uv pip $sub needs the network or a resolver; not available in a sandbox"; exit 2 ;;
    esac ;;
  run|tool)
    [[ $command == tool ]] && { [[ ${1:-} == run ]] || die "uv tool ${1:-} is not available offline"; shift; }
    with=() module=
    while (($#)); do
      case $1 in
        --with|-w) (($# >= 2)) || die "$1 needs a value"; with+=("$2"); shift 2 ;;
        --with=*) with+=("${1#*=}"); shift ;;
        --with-requirements) (($# >= 2)) || die "$1 needs a value"; with+=(-r "$2"); shift 2 ;;
        --with-requirements=*) with+=(-r "${1#*=}"); shift ;;
        -m|--module) module=1; shift ;;
        --from|-p|--python|--directory|--project|--env-file|--extra|--group|--index-url|-i|--extra-index-url|\
        --package|--cache-dir|--python-preference|--index|--default-index|--index-strategy|--keyring-provider|\
        --color|--config-file) (($# >= 2)) || die "$1 needs a value"; shift 2 ;;
        --*=*|--no-project|--isolated|--frozen|--locked|--no-sync|--active|--no-dev|--all-extras|--no-editable|\
        -q|--quiet|-v|--verbose|--offline|--no-cache|--native-tls|--no-progress|--no-config|--no-env-file|\
        --exact|--inexact|--no-python-downloads) shift ;;
        --) shift; break ;;
        -*) die "uv run $1: an option this offline stand-in does not know (nothing was run)" ;;
        *) break ;;
      esac
    done
    (($#)) || die "uv run: no command"
    # `uvx name@version`: the tool at that version (checked like a --with), run by its name
    if [[ $command == tool && $1 == ?*@?* && $1 != */* ]]; then with+=("${1%%@*}==${1#*@}"); set -- "${1%%@*}" "${@:2}"; fi
    ((${#with[@]})) && { check_installed "${with[@]}" || exit 1; }
    if [[ -n $module ]]; then set -- python3 -m "$@"; elif [[ $1 == *.py ]]; then set -- python3 "$@"; fi
    exec "$@" ;;
  *) say "uv $command needs the network or a project resolver; not available in a sandbox"; exit 2 ;;
esac
