"""threefold generated code for GPT: chunk 0 of 2.

plan:    tp=2,pp=2,dp=1,m=1,v=1,schedule=1f1b
rank:    pipeline stage 0 (model chunk 0, virtual 0), every tp rank of 2 (the tp rank is its tp group's, at run time)
covers:  wte, wpe, <top>, drop, h.0
Generated from the traced graph; edit the model, not this file.
"""
# content-hash: e680db4a6c337b82
import torch

from threefold.runtime.module import ChunkModule
import threefold.runtime.tp_ops as tp_ops

aten = torch.ops.aten


class Chunk0(ChunkModule):
    PARAMS = {
        'wte.weight': ([16, 16], 'float32'),
        'wpe.weight': ([16, 16], 'float32'),
        'h.0.ln_1.weight': ([16], 'float32'),
        'h.0.ln_1.bias': ([16], 'float32'),
        'h.0.attn.c_attn.weight': ([24, 16], 'float32'),
        'h.0.attn.c_attn.bias': ([24], 'float32'),
        'h.0.attn.c_proj.weight': ([16, 8], 'float32'),
        'h.0.attn.c_proj.bias': ([16], 'float32'),
        'h.0.ln_2.weight': ([16], 'float32'),
        'h.0.ln_2.bias': ([16], 'float32'),
        'h.0.mlp.c_fc.weight': ([32, 16], 'float32'),
        'h.0.mlp.c_fc.bias': ([32], 'float32'),
        'h.0.mlp.c_proj.weight': ([16, 32], 'float32'),
        'h.0.mlp.c_proj.bias': ([16], 'float32'),
    }
    BUFFERS = {
        'h.0.attn.mask': ([1, 1, 16, 16], 'bool'),
    }
    INPUTS = []
    USER_INPUTS = [0]
    OUTPUTS = ['add_2']

    def forward(self, idx):
        dev = self.device
        p_wte_weight = self.p('wte.weight')
        p_wpe_weight = self.p('wpe.weight')
        p_h_0_ln_1_weight = self.p('h.0.ln_1.weight')
        p_h_0_ln_1_bias = self.p('h.0.ln_1.bias')
        p_h_0_attn_c_attn_weight = self.p('h.0.attn.c_attn.weight')
        p_h_0_attn_c_attn_bias = self.p('h.0.attn.c_attn.bias')
        p_h_0_attn_c_proj_weight = self.p('h.0.attn.c_proj.weight')
        p_h_0_attn_c_proj_bias = self.p('h.0.attn.c_proj.bias')
        p_h_0_ln_2_weight = self.p('h.0.ln_2.weight')
        p_h_0_ln_2_bias = self.p('h.0.ln_2.bias')
        p_h_0_mlp_c_fc_weight = self.p('h.0.mlp.c_fc.weight')
        p_h_0_mlp_c_fc_bias = self.p('h.0.mlp.c_fc.bias')
        p_h_0_mlp_c_proj_weight = self.p('h.0.mlp.c_proj.weight')
        p_h_0_mlp_c_proj_bias = self.p('h.0.mlp.c_proj.bias')
        p_h_0_attn_mask = self.p('h.0.attn.mask')
        arange = aten.arange.default(8, device=dev, pin_memory=False)  # <top>  R  [8]  recomputed here
        wte = tp_ops.vocab_parallel_embedding(p_wte_weight, idx, self.tp_group)  # wte  R  [2, 8, 16]
        wpe = aten.embedding.default(p_wpe_weight, arange)  # wpe  R  [8, 16]
        add = aten.add.Tensor(wte, wpe)  # <top>  R  [2, 8, 16]
        drop = aten.dropout.default(add, 0.0, True)  # drop  R  [2, 8, 16]
        h0_ln_1 = aten.layer_norm.default(  # h.0.ln_1  R  [2, 8, 16]
            drop, [16], p_h_0_ln_1_weight, p_h_0_ln_1_bias, 1e-05, False)
        h0_attn_c_attn_f = tp_ops.f(h0_ln_1, self.tp_group)  # h.0.attn.c_attn  R(f)  [2, 8, 16]
        h0_attn_c_attn_linear = aten.linear.default(  # h.0.attn.c_attn  S(2,blocks=[16, 16, 16])  [2, 8, 24]
            h0_attn_c_attn_f, p_h_0_attn_c_attn_weight, p_h_0_attn_c_attn_bias)
        h0_attn_split_with_sizes = aten.split_with_sizes.default(  # h.0.attn  (S(2), S(2), S(2))  [2, 8, 8] x3
            h0_attn_c_attn_linear, [8, 8, 8], 2)
        h0_attn_split_with_sizes_0 = h0_attn_split_with_sizes[0]  # h.0.attn  S(2)  [2, 8, 8]
        h0_attn_split_with_sizes_1 = h0_attn_split_with_sizes[1]  # h.0.attn  S(2)  [2, 8, 8]
        h0_attn_split_with_sizes_2 = h0_attn_split_with_sizes[2]  # h.0.attn  S(2)  [2, 8, 8]
        h0_attn_view = aten.view.default(h0_attn_split_with_sizes_0, [2, 8, 1, 8])  # h.0.attn  S(2)  [2, 8, 1, 8]
        h0_attn_transpose = aten.transpose.int(h0_attn_view, 1, 2)  # h.0.attn  S(1)  [2, 1, 8, 8]
        h0_attn_view_1 = aten.view.default(h0_attn_split_with_sizes_1, [2, 8, 1, 8])  # h.0.attn  S(2)  [2, 8, 1, 8]
        h0_attn_transpose_1 = aten.transpose.int(h0_attn_view_1, 1, 2)  # h.0.attn  S(1)  [2, 1, 8, 8]
        h0_attn_view_2 = aten.view.default(h0_attn_split_with_sizes_2, [2, 8, 1, 8])  # h.0.attn  S(2)  [2, 8, 1, 8]
        h0_attn_transpose_2 = aten.transpose.int(h0_attn_view_2, 1, 2)  # h.0.attn  S(1)  [2, 1, 8, 8]
        h0_attn_transpose_3 = aten.transpose.int(h0_attn_transpose_1, -2, -1)  # h.0.attn  S(1)  [2, 1, 8, 8]
        h0_attn_matmul = aten.matmul.default(h0_attn_transpose, h0_attn_transpose_3)  # h.0.attn  S(1)  [2, 1, 8, 8]
        h0_attn_mul = aten.mul.Tensor(h0_attn_matmul, 0.35355339059327373)  # h.0.attn  S(1)  [2, 1, 8, 8]
        h0_attn_slice = aten.slice.Tensor(p_h_0_attn_mask, 2, 0, 8)  # h.0.attn  R  [1, 1, 8, 16]  recomputed here
        h0_attn_slice_1 = aten.slice.Tensor(h0_attn_slice, 3, 0, 8)  # h.0.attn  R  [1, 1, 8, 8]  recomputed here
        h0_attn_bitwise_not = aten.bitwise_not.default(h0_attn_slice_1)  # h.0.attn  R  [1, 1, 8, 8]  recomputed here
        h0_attn_masked_fill = aten.masked_fill.Scalar(  # h.0.attn  S(1)  [2, 1, 8, 8]
            h0_attn_mul, h0_attn_bitwise_not, -float("inf"))
        h0_attn_softmax = aten.softmax.int(h0_attn_masked_fill, -1)  # h.0.attn  S(1)  [2, 1, 8, 8]
        h0_attn_attn_dropout = aten.dropout.default(  # h.0.attn.attn_dropout  S(1)  [2, 1, 8, 8]
            h0_attn_softmax, 0.0, True)
        h0_attn_matmul_1 = aten.matmul.default(  # h.0.attn  S(1)  [2, 1, 8, 8]
            h0_attn_attn_dropout, h0_attn_transpose_2)
        h0_attn_transpose_4 = aten.transpose.int(h0_attn_matmul_1, 1, 2)  # h.0.attn  S(2)  [2, 8, 1, 8]
        h0_attn_contiguous = aten.contiguous.default(h0_attn_transpose_4)  # h.0.attn  S(2)  [2, 8, 1, 8]
        h0_attn_view_3 = aten.view.default(h0_attn_contiguous, [2, 8, 8])  # h.0.attn  S(2)  [2, 8, 8]
        h0_attn_c_proj_linear = aten.linear.default(  # h.0.attn.c_proj  P  [2, 8, 16]
            h0_attn_view_3, p_h_0_attn_c_proj_weight)
        h0_attn_c_proj_g = tp_ops.g(h0_attn_c_proj_linear, self.tp_group)  # h.0.attn.c_proj  R  [2, 8, 16]
        h0_attn_c_proj_add = aten.add.Tensor(h0_attn_c_proj_g, p_h_0_attn_c_proj_bias)  # h.0.attn.c_proj  R  [2, 8, 16]
        h0_attn_resid_dropout = aten.dropout.default(  # h.0.attn.resid_dropout  R  [2, 8, 16]
            h0_attn_c_proj_add, 0.0, True)
        h0_add = aten.add.Tensor(drop, h0_attn_resid_dropout)  # h.0  R  [2, 8, 16]
        h0_ln_2 = aten.layer_norm.default(  # h.0.ln_2  R  [2, 8, 16]
            h0_add, [16], p_h_0_ln_2_weight, p_h_0_ln_2_bias, 1e-05, False)
        h0_mlp_c_fc_f = tp_ops.f(h0_ln_2, self.tp_group)  # h.0.mlp.c_fc  R(f)  [2, 8, 16]
        h0_mlp_c_fc_linear = aten.linear.default(  # h.0.mlp.c_fc  S(2)  [2, 8, 32]
            h0_mlp_c_fc_f, p_h_0_mlp_c_fc_weight, p_h_0_mlp_c_fc_bias)
        h0_mlp_gelu = aten.gelu.default(h0_mlp_c_fc_linear)  # h.0.mlp  S(2)  [2, 8, 32]
        h0_mlp_c_proj_linear = aten.linear.default(  # h.0.mlp.c_proj  P  [2, 8, 16]
            h0_mlp_gelu, p_h_0_mlp_c_proj_weight)
        h0_mlp_c_proj_g = tp_ops.g(h0_mlp_c_proj_linear, self.tp_group)  # h.0.mlp.c_proj  R  [2, 8, 16]
        h0_mlp_c_proj_add = aten.add.Tensor(h0_mlp_c_proj_g, p_h_0_mlp_c_proj_bias)  # h.0.mlp.c_proj  R  [2, 8, 16]
        h0_mlp_dropout = aten.dropout.default(h0_mlp_c_proj_add, 0.0, True)  # h.0.mlp.dropout  R  [2, 8, 16]
        h0_add_1 = aten.add.Tensor(h0_add, h0_mlp_dropout)  # h.0  R  [2, 8, 16]
        return (h0_add_1, )  # OUTPUTS ['add_2']
