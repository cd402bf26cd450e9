# apt-get (and apt) as a grader's test.sh finds it in a sandbox: offline. Harbor's own test.sh template starts with
# `apt-get update` and `apt-get install -y curl` under `set -e`; a sandbox has no network, so the real ones fail and
# the script stops before its tests run. Here `update` keeps the image's package lists (nothing is fetched), and
# `install` succeeds when every package it names is already installed in the image, and fails naming those that are
# not (install them in the task's image: environment/Dockerfile).
#   bash apt.sh apt-get ARGS...   or   bash apt.sh apt ARGS...
set -u
tool=${1:?}; shift
say() { echo "$tool (sandforge, offline): $*" >&2; }
command= packages=()
while (($#)); do
  case $1 in
    -o|-c|-t|--option|--config-file|--target-release) shift 2 ;;
    -*) shift ;;
    *) if [[ -z $command ]]; then command=$1; else packages+=("$1"); fi; shift ;;
  esac
done
case $command in
  update) say "no network: the image's own package lists stand (nothing fetched)" ;;
  install)
    missing=()
    for p in "${packages[@]}"; do
      name=${p%%=*}; name=${name%%:*}
      dpkg-query -W -f='${Status}' "$name" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    if ((${#missing[@]})); then
      say "not installed, and sandboxes have no network: ${missing[*]} (install it in the task's image: environment/Dockerfile)"
      exit 100
    fi
    ((${#packages[@]})) && say "already installed: ${packages[*]}" ;;
  clean|autoclean|autoremove) ;;
  "") say "no command"; exit 100 ;;
  *) say "$command needs the network or changes the image; not available in a sandbox"; exit 100 ;;
esac
