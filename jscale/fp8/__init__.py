"""FP8 training: scaled FP8 matmuls on chosen linear layers (`fp8.*` config keys).

`scaling`: formats, power-of-two scales, quantisation, amax histories. `dot`: the FP8
dot_general and its backward (a custom_vjp). `linears`: which layers take it, and the scale
state they keep between steps. `grouped`: the routed experts' tiled products in FP8, scaled
per expert or per row. `wire`: the expert exchange's rows sent in FP8 (the FP8 dispatch).
"""
