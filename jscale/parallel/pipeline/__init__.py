"""Pipeline parallelism: schedules as data (`schedules`), pictures (`timeline`), the table
compiled for the executor (`program`), the executor (`executor`), the stage region in both
modes (`region`) and the layer layout (`layout`). The train step's use of them is
`jscale.step.pipelined`."""
