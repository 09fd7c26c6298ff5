"""The executed tables of the pipeline schedules against the papers' figures, without running
anything: bubble (idle over useful ticks, F = B = W = 1) and the most residual sets a stage
holds, for p stages and m = p .. 4p micro-batches, beside `schedules.theory_bubble` and
`theory_in_flight`, and as the executor runs them in lockstep; plus the V schedules' timelines
(ASCII and PNG).

  python scripts/pipeline_tables.py [--stages 4,8] [--out results/pipeline_v_tables.md]

ZB-V (Qi et al.) and DualPipeV (DeepSeek) with v = 2 chunks per stage in the V; ZB-H1 and 1F1B
for reference (their ticks are a whole stage's: twice a V chunk's).
"""

import argparse
import os

from jscale.parallel.pipeline import lockstep, program, schedules, timeline

ROWS = (("1f1b", 1), ("zero_bubble", 1), ("zbv", 2), ("dualpipev", 2))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--stages", default="4,8")
  parser.add_argument("--out", default="results/pipeline_v_tables.md")
  args = parser.parse_args()
  outdir = os.path.dirname(args.out) or "."
  os.makedirs(outdir, exist_ok=True)
  lines = ["Executed tables (`schedules.make_table`) against the papers' figures: bubble = idle "
           "over useful ticks (F = B = W = 1; the V schedules' ticks are half a stage's); "
           "residual sets = the most (micro-batch, chunk) sets a stage holds from F to W "
           "(V chunks are half a stage); in flight = from F to B; lockstep = the bubble of the "
           "papers' table run in lockstep, each tick as long as its longest op "
           "(`Table.lockstep_bubble`); executed = the lockstep bubble of the table the executor "
           "runs (`lockstep.executed_table`: re-timed in steps where that pays) and its executed "
           "ticks (one `lax.scan` iteration each, `Program.rows`). Produced by "
           "`python scripts/pipeline_tables.py`.", "",
           "| schedule | p | m | ticks | bubble | theory | lockstep | residual sets | theory |"
           " in flight | pairs | executed | executed ticks |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for p in (int(x) for x in args.stages.split(",")):
    for name, v in ROWS:
      for m in range(p, 4 * p + 1, max(1, p // 2)):
        if schedules.why_not(name, p, m, v):
          continue
        t = schedules.make_table(name, p, m, v)
        schedules.validate(t)
        run = lockstep.executed_table(name, p, m, v)
        schedules.validate(run)
        lines.append(
            f"| {name} | {p} | {m} | {t.ticks} | {t.bubble():.4f} | "
            f"{schedules.theory_bubble(name, p, m, v):.4f} | {t.lockstep_bubble():.4f} | "
            f"{t.live().max()} | "
            f"{schedules.theory_in_flight(name, p, m, v)} | {t.in_flight().max()} | "
            f"{int(t.paired().sum())} | {run.lockstep_bubble():.4f} | "
            f"{len(program.compile_program(run).rows)} |")
  pictures = []
  for name, m in (("zbv", 8), ("dualpipev", 8), ("dualpipev", 10)):
    table = schedules.make_table(name, 4, m, 2)
    pictures.append(timeline.ascii_timeline(table))
    timeline.render_png(table, os.path.join(outdir, f"pipeline_{name}_p4_m{m}.png"))
  run = lockstep.executed_table("dualpipev", 4, 8, 2)
  pictures.append("as the executor runs it (`lockstep.executed_table`: re-timed in steps, ops "
                  "start together)\n" + timeline.ascii_timeline(run))
  for path, text in ((args.out, "\n".join(lines)),
                     (os.path.join(outdir, "pipeline_v_timelines.txt"), "\n\n".join(pictures))):
    with open(path, "w") as f:
      f.write(text + "\n")
    print(text)


if __name__ == "__main__":
  main()
