#!/usr/bin/env bash
# The alert rules and the Grafana dashboard of docs/ (CI's step "alert rules"):
# - `promtool check rules` and `promtool test rules` (docs/prometheus-alerts.test.yml:
#   each alert fires on the series that should fire it, not before its `for`);
# - every metric they name is one the outbox emits (outbox-core's METRICS in
#   telemetry.rs, the Kafka publisher's own), so a renamed metric cannot leave an alert
#   or a panel silently empty; the dashboard is JSON.
# Needs promtool: `eval "$(scripts/services.sh)"` sets OUTBOX_PROMTOOL.
set -euo pipefail
cd "$(dirname "$0")/.."
promtool="${OUTBOX_PROMTOOL:-$(command -v promtool || true)}"
[ -x "$promtool" ] || { echo "check-alerts: promtool not found: run eval \"\$(scripts/services.sh)\" (it sets OUTBOX_PROMTOOL)" >&2; exit 1; }
"$promtool" check rules docs/prometheus-alerts.yml
(cd docs && "$promtool" test rules prometheus-alerts.test.yml)
python3 - <<'PY'
import json, re, sys
core = open("outbox-core/src/telemetry.rs").read().split("#[cfg(test)]")[0]
known = set(re.findall(r'"(outbox_[a-z_]+)"', core))
known |= set(re.findall(r'"(outbox_[a-z_]+)"', open("outbox-kafka/src/publisher/producer.rs").read()))
json.load(open("docs/grafana-dashboard.json"))
bad = []
for path in ["docs/prometheus-alerts.yml", "docs/prometheus-alerts.test.yml", "docs/grafana-dashboard.json"]:
    for name in sorted(set(re.findall(r'\b(outbox_[a-z_]+)', open(path).read()))):
        base = re.sub(r'_(sum|count|bucket)$', '', name)
        if name not in known and base not in known:
            bad.append(f"{path}: {name} is not a metric the outbox emits (outbox-core/src/telemetry.rs)")
if bad:
    print("\n".join(bad), file=sys.stderr)
    sys.exit(1)
print(f"check-alerts: every metric named in the alerts, their tests and the dashboard is emitted ({len(known)} known)")
PY
