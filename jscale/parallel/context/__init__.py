"""Context parallelism (playbook: "Context parallelism"): the sequence split over `sequence`.

  * `order`: the token order the data pipeline applies (contiguous, or zig-zag for balance).
  * `ring`: ring attention by hand (`ppermute` of K/V blocks, zig-zag aware).
  * `modes`: the seam's attention in both modes (xla: the all-gather variant or the ring on
    XLA's shards; manual: the ring).
"""
