# PATH with only the folders the policy cannot write, for a root grader (sandforge/grading/startup.py): a policy-writable
# folder on PATH (an image's `ENV PATH=/app/.venv/bin:$PATH`, its venv in the WORKDIR) would let it replace the
# programs root runs. Trusted as in _sandforge_imports.py: not the policy's uid's, not writable by others, nor by a group of its
# (SANDFORGE_POLICY_IDS: uid, then groups); relative and missing entries go. A root policy (uid 0): PATH as it is.
#   PATH=$(bash path.sh)
read -ra ids <<< "${SANDFORGE_POLICY_IDS:-}"
uid=${ids[0]:-0} groups=" ${ids[*]:1} "
if [[ $uid == 0 ]]; then printf '%s' "$PATH"; exit 0; fi
keep=
IFS=: read -ra dirs <<< "$PATH"
for d in "${dirs[@]}"; do
  [[ $d == /* && -d $d ]] || continue
  read -r u g m < <(stat -L -c '%u %g %a' -- "$d" 2>/dev/null) || continue
  m=$((8#$m))
  (( u == uid || m & 2 )) && continue
  (( m & 16 )) && [[ $groups == *" $g "* ]] && continue
  keep+=${keep:+:}$d
done
printf '%s' "$keep"
