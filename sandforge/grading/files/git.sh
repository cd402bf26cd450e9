# git as a root grader finds it in a sandbox (sandforge/grading/startup.py): it reads the policy's repository, never runs
# what the policy's configuration names. Root's git refuses a repository another user owns ("dubious ownership",
# exit 128), and trusting it (safe.directory) would read its .git/config, whose core.fsmonitor, hooks, filter and
# diff drivers, pager and editor are commands. So for such a repository git runs on a view of it: a root-owned
# folder whose entries link to the repository's (objects, refs, logs, ...), with HEAD and the index copied, no hooks,
# and a config of the repository's settings that run nothing (its format, extensions, file modes, line endings,
# identity). The .gitattributes of the work tree may still name a driver: with no config defining it, git runs none.
# What a grader's git writes on purpose (a commit, a stash) goes into the repository's own objects and refs.
#   bash git.sh ARGS...   (as `git`; a repository root owns is git's own. One named by GIT_DIR or --git-dir is read on
#   the view too: git runs no ownership check on an explicit one, so it would read the policy's config as root.)
set -u
real=$(type -P git) || { echo "git: not installed" >&2; exit 127; }
[[ $(id -u) == 0 ]] || exec "$real" "$@"

# where git would look: its -C folders, in order, and an explicit repository and work tree (taken out of the
# arguments: the view stands in for them)
dir=$PWD i=1 explicit=${GIT_DIR:-} tree=${GIT_WORK_TREE:-} args=()
while ((i <= $#)); do
  a=${!i}
  case $a in
    -C) ((i++)); c=${!i:-}; args+=(-C "$c"); [[ $c == /* ]] && dir=$c || dir=$dir/$c ;;
    -c|--exec-path|--namespace|--super-prefix|--config-env) ((i++)); args+=("$a" "${!i:-}") ;;
    --git-dir) ((i++)); explicit=${!i:-} ;;
    --git-dir=*) explicit=${a#--git-dir=} ;;
    --work-tree) ((i++)); tree=${!i:-} ;;
    --work-tree=*) tree=${a#--work-tree=} ;;
    -*) args+=("$a") ;;
    *) break ;;
  esac
  ((i++))
done
args+=("${@:i}")
if [[ -n $explicit ]]; then
  [[ $explicit == /* ]] || explicit=$dir/$explicit
  gitdir=$(cd -- "$explicit" 2>/dev/null && pwd -P) || exec "$real" "$@"  # no such folder: git's own error
  top=${tree:-$dir}
  [[ $top == /* ]] || top=$dir/$top
  [[ -d $top ]] || exec "$real" "$@"
else
  probe() { "$real" -C "$dir" -c safe.directory='*' rev-parse "$1" 2>/dev/null; }  # reads no index, runs no child
  gitdir=$(probe --absolute-git-dir) || exec "$real" "$@"
  top=$(probe --show-toplevel) || top=${gitdir%/.git}  # run from inside .git: its work tree is the folder above
  [[ $top != "$gitdir" && -d $top ]] || exec "$real" "$@"  # a bare repository: git's own rules
fi
if [[ $(stat -c %u "$gitdir") == 0 && $(stat -c %u "$top") == 0 ]]; then exec "$real" "$@"; fi

common=$gitdir
if [[ -f $gitdir/commondir ]]; then  # a linked work tree: its objects and refs are the main repository's
  c=$(head -c 4096 "$gitdir/commondir"); c=${c%%$'\n'*}
  [[ $c == /* ]] && common=$c || common=$gitdir/$c
fi
view=$(mktemp -d "$(dirname -- "${BASH_SOURCE[0]}")/git.XXXXXX") || exit 128  # root's own spool
trap 'rm -rf -- "$view"' EXIT
shopt -s nullglob dotglob
for e in "$common"/* "$gitdir"/*; do
  name=${e##*/}
  case $name in config|config.worktree|hooks|HEAD|index|commondir|gitdir|*.lock) continue ;; esac
  ln -sfn -- "$e" "$view/$name"
done
[[ -f $gitdir/HEAD && ! -L $gitdir/HEAD ]] && head -c 4096 "$gitdir/HEAD" > "$view/HEAD"
# the index is copied (git's lock files follow links: a linked index would be written where the policy points it)
if [[ -f $gitdir/index && ! -L $gitdir/index ]] && (($(stat -c %s "$gitdir/index") <= 16 << 20)); then
  cp -- "$gitdir/index" "$view/index"
fi
# settings that change what git reads or shows and run nothing; every other key is left out
{
  echo "[core]"; echo "	bare = false"
  "$real" config --file "$common/config" --no-includes --get-regexp \
    '^(core\.(repositoryformatversion|filemode|symlinks|ignorecase|precomposeunicode|autocrlf|eol|safecrlf|quotepath|sparsecheckout|sparsecheckoutcone|abbrev|checkstat|trustctime)|extensions\.(objectformat|refstorage|worktreeconfig|preciousobjects)|index\.(version|skiphash)|user\.(name|email)|init\.defaultbranch)$' \
    2>/dev/null | head -n 64 | while read -r key value; do
      printf '[%s]\n\t%s = %s\n' "${key%.*}" "${key##*.}" "$(printf %s "$value" | tr -d '"\\')"
    done
} > "$view/config"
# No trust is passed down: the view is root's, so git needs no safe.directory for it, and a child git (a submodule's
# status) on a folder the policy owns meets git's own ownership refusal instead of reading its config as root.
# Submodules are not entered (their changes are not what a grader reads in the top repository's status and diff).
GIT_DIR=$view GIT_WORK_TREE=$top GIT_OPTIONAL_LOCKS=0 "$real" -c diff.ignoreSubmodules=all "${args[@]}"
