"""Formats `pgcdc tail` JSON lines as one short line per event (for the quickstart)."""
import json
import sys

for line in sys.stdin:
    e = json.loads(line)
    where = f"{e['topic']} p{e['partition']}@{e['offset']}"
    v = e["value"]
    if v is None:
        print(f"{where}  key={e['key']}  tombstone")
        continue
    row = v["after"] or v["before"]
    src = v["source"]
    print(f"{where}  op={v['op']}  key={e['key']}  status={row['status']}  amount={row['amount']}"
          f"  position=({src['commit_lsn']},{src['seq']})")
