"""The canonical form: one spelling of every pattern whatever the exporter wrote, so that the rules see a single
form. The steps, in the order they run, are declared in ``sdnpu.passes.pipeline`` (``CANONICAL``); each module
here holds one concern:

    driver       the node-rewrite driver (``NodeRewrite``: anchors and ``rewrite(node) -> bool``; the loop,
                 the count and the dead-node sweep are the driver's) and the dead-node sweep step
    constants    the opset raised to 20, Constant nodes lifted, shapes inferred, constants folded (onnxscript's
                 folder, then sdnpu's small folder in rounds), nodes named, crops of constants, the finish
                 (output names, the crops' record); ``bind_input_shapes``
    noops        neutral and no-op removal: Identity, x*1 / x/1 / x+0, same-type Casts, Expands and Reshapes to
                 the shape they have, an Expand below the element-wise op only it widens, Expands read by ops
                 that broadcast anyway, movements that move nothing,
                 softmax NaN guards; a constant-mask Where as a Mul and an Add
    activations  activation spellings: GELU's Erf and tanh forms as one Gelu, 1 / x as Reciprocal
    movement     movement normal forms: Reshape for Squeeze / Unsqueeze / Flatten, explicit Transpose perms,
                 Tile and the head repeat's Expand as Concat, a zero Pad into its Conv (any rank), nearest
                 upsampling gathers and pixel repeats as Resize, Einsum as Transpose / MatMul (an outer
                 product a Mul), row-block ScatterND as Concat, ScatterNDs writing every row in turn as an
                 interleave, broadcast chains as one Expand or a constant
    convs        a Conv3d or Conv1d as the 2-D Conv over a view of its input (frames folded into the batch, a
                 temporal conv over the [B, C, F, H*W] view, frames stacked in channels)
    sinusoids    the sinusoidal embeddings as one Sin with a phase; several inputs' chains as one
    loops        per-item loops an exporter unrolled, as the batched movement they are
    tables       the CPU tables computed from the graph's inputs, in as few nodes as it takes
    rotary       the rotary embeddings' rotation as a MatMul by a signed permutation; a rotation by constant
                 tables in any spelling (2 x 2 matrices, the halves' products joined or interleaved) as
                 x * A + (x @ P) * B
    heads        the head split's Transpose moved below the per-head arithmetic (the rotary, whole or on parts
                 of each head, the grouped-query repeat) down to the attention's products, which read the heads
                 through it

This package imports nothing at the top: its modules import each other, and ``sdnpu.passes.pipeline`` imports
them.
"""
