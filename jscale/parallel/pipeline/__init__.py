"""Pipeline parallelism: schedules as data (`schedules`), pictures (`timeline`), the table
compiled for the executor (`program`), the executor (`executor`), layer layout (`layout`) and
the train-step glue (`step`)."""
