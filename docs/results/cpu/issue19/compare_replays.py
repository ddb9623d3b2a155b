#!/usr/bin/env python3
"""Compares the replay JSON Lines of two runs (before/after), ignoring timings; prints a summary."""
import json, sys
before, after = sys.argv[1], sys.argv[2]
TIME_KEYS = ('host_ns_per_op', 'host_ns_per_op_runs', 'sync_host_ns', 'vm_host_ns', 'seconds')
def strip(x):
    if isinstance(x, dict):
        return {k: strip(v) for k, v in x.items() if k not in TIME_KEYS}
    if isinstance(x, list):
        return [strip(v) for v in x]
    return x
bad = 0
for mode in ('default', 'expandable', 'fit_expandable'):
    a = [json.loads(l) for l in open(f'{before}/{mode}.jsonl')]
    b = [json.loads(l) for l in open(f'{after}/{mode}.jsonl')]
    assert len(a) == len(b), mode
    for x, y in zip(a, b):
        name = x.get('trace', '?').split('/')[-1]
        sx, sy = strip(x), strip(y)
        keys = ['peak_reserved_bytes', 'device_alloc_calls', 'device_free_calls', 'vm_calls',
                'min_capacity_bytes', 'fit_bytes']
        shown = {k: x.get(k) for k in x if k in keys or k.startswith('vm_') or 'fit' in k or k.startswith('min_')}
        same = sx == sy
        bad += not same
        print(f"{mode:15s} {name:28s} {'identical' if same else 'DIFFERENT'} {json.dumps({k: v for k, v in shown.items() if not isinstance(v, (dict, list))}, sort_keys=True)}")
        if not same:
            for k in sorted(set(sx) | set(sy)):
                if sx.get(k) != sy.get(k):
                    print(f"    {k}: {json.dumps(sx.get(k))[:200]} -> {json.dumps(sy.get(k))[:200]}")
print('all identical (timings excepted)' if bad == 0 else f'{bad} differ')
sys.exit(bad != 0)
