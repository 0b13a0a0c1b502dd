import json
rows = json.load(open("/tmp/replay-ov/replay_overlap.json"))
short = lambda p: p.replace("h200-2026-", "").split("/fulldepth-")[0]
print("| results | model | budget | link | S | TPOT spec g/s | TPOT hyb g/s | rec ov | rec placed | placed @0/.5/1 | pred off | pred placed @0/.5/1 | replay off | replay @0/.5/1 |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    if r["results"].startswith("/work/.device"):
        continue  # byte-identical to 12-03/qwen3-d2-overlap1
    b = r["by_overlap"]; o = ["0.0", "0.5", "1.0"]
    f = lambda x: f"{x:.2f}" if x < 100 else f"{x:.0f}"
    name = short(r["results"]) + ("*" if r["borrowed_trace"] else "")
    print(f"| {name} | {r['model'].split()[0]} | {r['setting'][7:9]} | {r['link'][:6]} | {r['slots']} | {r['tpot_specter']} | {r['tpot_hybrid']} | "
          f"{r['rec_overlap']:g} | {r['rec_host']} | {'/'.join(str(b[k]['host']) for k in o)} | {f(b['0.0']['pred_off_ms'])} | "
          f"{'/'.join(f(b[k]['pred_placed_ms']) for k in o)} | {f(r['replay_off_ms'])} | {'/'.join(f(b[k]['replay_ms']) for k in o)} |")
