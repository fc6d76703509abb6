#!/usr/bin/env bash
# Slurm 22.05 + munge for tests/infra/test_slurm*.py; the tests start and stop the daemons themselves
# (slurm/cluster.sh). Idempotent. .ci/run has already run `apt-get update`.
set -euo pipefail
pkgs=(slurmctld slurmd slurm-client munge)
installed=$(dpkg-query -W -f='${Status}\n' "${pkgs[@]}" 2>/dev/null | grep -c '^install ok installed$' || true)
if [ "$installed" != "${#pkgs[@]}" ]; then
  log=$(mktemp)
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >"$log" 2>&1; then
    cat "$log" >&2; rm -f "$log"; exit 1
  fi
  rm -f "$log"
fi
# The two-node test cluster runs two slurmd on this host as n1 and n2; c10d and slurmd need the names.
for h in n1 n2; do
  getent hosts "$h" >/dev/null || echo "127.0.0.1 $h" >>/etc/hosts
done
echo "slurm: $(slurmctld -V), hosts n1 n2 -> $(getent hosts n1 | awk '{print $1}')"
