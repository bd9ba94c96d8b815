"""The evidence report (`kvstrata bench report`): every figure and table of the seeds'
promises measured in one run, then rendered from the measured data alone.

    scale.py      how much each section measures (smoke / quick / full)
    session.py    what the sections of one run share
    machine.py    the machine description recorded with the numbers
    quality.py    strategy table (decode, bytes, ΔPPL, greedy) and codec bits vs error
    sweeps.py     resident fraction vs speed, context vs device bytes and step time
    system.py     block size vs tier transfers, prefix reuse, engine concurrency
    compression.py  modes that store or read fewer KV bytes (delta coding ...): each a
                  sub-table measured on real K/V, measured and rendered there
    predicted.py  `kvstrata plan` next to the measured bytes and step times (measured
                  and rendered there)
    figures.py    the PNG figures (matplotlib, the `report` extra)
    markdown.py   report.md (tables.py: its Markdown tables)
    output.py     writes report.json, the figures and report.md from the data alone

The measuring code is the benchmarks' own (`kvstrata.bench.*`, `kvstrata.quality.evaluate`,
`kvstrata.quality.agreement`): the sections choose variants and sizes and collect the results.
"""
