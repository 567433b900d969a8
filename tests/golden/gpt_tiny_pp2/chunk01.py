"""threefold generated code for GPT: chunk 1 of 2.

plan:    tp=1,pp=2,dp=1,m=1,v=1,schedule=1f1b
rank:    pipeline stage 1 (model chunk 1, virtual 0), every tp rank of 1 (the tp rank is its tp group's, at run time)
covers:  h.1, ln_f, lm_head, <top>
Generated from the traced graph; edit the model, not this file.
"""
# content-hash: 3dde51f3293f65d5
import torch

from threefold.runtime.module import ChunkModule

aten = torch.ops.aten


class Chunk1(ChunkModule):
    PARAMS = {
        'wte.weight': ([32, 16], 'float32'),
        'h.1.ln_1.weight': ([16], 'float32'),
        'h.1.ln_1.bias': ([16], 'float32'),
        'h.1.attn.c_attn.weight': ([48, 16], 'float32'),
        'h.1.attn.c_attn.bias': ([48], 'float32'),
        'h.1.attn.c_proj.weight': ([16, 16], 'float32'),
        'h.1.attn.c_proj.bias': ([16], 'float32'),
        'h.1.ln_2.weight': ([16], 'float32'),
        'h.1.ln_2.bias': ([16], 'float32'),
        'h.1.mlp.c_fc.weight': ([64, 16], 'float32'),
        'h.1.mlp.c_fc.bias': ([64], 'float32'),
        'h.1.mlp.c_proj.weight': ([16, 64], 'float32'),
        'h.1.mlp.c_proj.bias': ([16], 'float32'),
        'ln_f.weight': ([16], 'float32'),
        'ln_f.bias': ([16], 'float32'),
    }
    BUFFERS = {
        'h.1.attn.mask': ([1, 1, 16, 16], 'bool'),
    }
    INPUTS = ['add_2']
    USER_INPUTS = [1]
    OUTPUTS = ['cross_entropy_loss']
    MODEL_OUTPUT_INPUTS = []

    def forward(self, add_2, target):
        p_wte_weight = self.p('wte.weight')
        p_h_1_ln_1_weight = self.p('h.1.ln_1.weight')
        p_h_1_ln_1_bias = self.p('h.1.ln_1.bias')
        p_h_1_attn_c_attn_weight = self.p('h.1.attn.c_attn.weight')
        p_h_1_attn_c_attn_bias = self.p('h.1.attn.c_attn.bias')
        p_h_1_attn_c_proj_weight = self.p('h.1.attn.c_proj.weight')
        p_h_1_attn_c_proj_bias = self.p('h.1.attn.c_proj.bias')
        p_h_1_ln_2_weight = self.p('h.1.ln_2.weight')
        p_h_1_ln_2_bias = self.p('h.1.ln_2.bias')
        p_h_1_mlp_c_fc_weight = self.p('h.1.mlp.c_fc.weight')
        p_h_1_mlp_c_fc_bias = self.p('h.1.mlp.c_fc.bias')
        p_h_1_mlp_c_proj_weight = self.p('h.1.mlp.c_proj.weight')
        p_h_1_mlp_c_proj_bias = self.p('h.1.mlp.c_proj.bias')
        p_ln_f_weight = self.p('ln_f.weight')
        p_ln_f_bias = self.p('ln_f.bias')
        p_h_1_attn_mask = self.p('h.1.attn.mask')
        h1_ln_1 = aten.layer_norm.default(  # h.1.ln_1  R  [2, 8, 16]
            add_2, [16], p_h_1_ln_1_weight, p_h_1_ln_1_bias, 1e-05, False)
        h1_attn_c_attn = aten.linear.default(  # h.1.attn.c_attn  R  [2, 8, 48]
            h1_ln_1, p_h_1_attn_c_attn_weight, p_h_1_attn_c_attn_bias)
        h1_attn_split = aten.split.Tensor(h1_attn_c_attn, 16, 2)  # h.1.attn  R  [2, 8, 16] x3
        h1_attn_split_0 = h1_attn_split[0]  # h.1.attn  R  [2, 8, 16]
        h1_attn_split_1 = h1_attn_split[1]  # h.1.attn  R  [2, 8, 16]
        h1_attn_split_2 = h1_attn_split[2]  # h.1.attn  R  [2, 8, 16]
        h1_attn_view = aten.view.default(h1_attn_split_0, [2, 8, 2, 8])  # h.1.attn  R  [2, 8, 2, 8]
        h1_attn_transpose = aten.transpose.int(h1_attn_view, 1, 2)  # h.1.attn  R  [2, 2, 8, 8]
        h1_attn_view_1 = aten.view.default(h1_attn_split_1, [2, 8, 2, 8])  # h.1.attn  R  [2, 8, 2, 8]
        h1_attn_transpose_1 = aten.transpose.int(h1_attn_view_1, 1, 2)  # h.1.attn  R  [2, 2, 8, 8]
        h1_attn_view_2 = aten.view.default(h1_attn_split_2, [2, 8, 2, 8])  # h.1.attn  R  [2, 8, 2, 8]
        h1_attn_transpose_2 = aten.transpose.int(h1_attn_view_2, 1, 2)  # h.1.attn  R  [2, 2, 8, 8]
        h1_attn_transpose_3 = aten.transpose.int(h1_attn_transpose_1, -2, -1)  # h.1.attn  R  [2, 2, 8, 8]
        h1_attn_matmul = aten.matmul.default(h1_attn_transpose, h1_attn_transpose_3)  # h.1.attn  R  [2, 2, 8, 8]
        h1_attn_mul = aten.mul.Tensor(h1_attn_matmul, 0.35355339059327373)  # h.1.attn  R  [2, 2, 8, 8]
        h1_attn_slice = aten.slice.Tensor(p_h_1_attn_mask, 2, 0, 8)  # h.1.attn  R  [1, 1, 8, 16]  recomputed here
        h1_attn_slice_1 = aten.slice.Tensor(h1_attn_slice, 3, 0, 8)  # h.1.attn  R  [1, 1, 8, 8]  recomputed here
        h1_attn_bitwise_not = aten.bitwise_not.default(h1_attn_slice_1)  # h.1.attn  R  [1, 1, 8, 8]  recomputed here
        h1_attn_masked_fill = aten.masked_fill.Scalar(  # h.1.attn  R  [2, 2, 8, 8]
            h1_attn_mul, h1_attn_bitwise_not, -float("inf"))
        h1_attn_softmax = aten.softmax.int(h1_attn_masked_fill, -1)  # h.1.attn  R  [2, 2, 8, 8]
        h1_attn_attn_dropout = aten.dropout.default(  # h.1.attn.attn_dropout  R  [2, 2, 8, 8]
            h1_attn_softmax, 0.0, True)
        h1_attn_matmul_1 = aten.matmul.default(h1_attn_attn_dropout, h1_attn_transpose_2)  # h.1.attn  R  [2, 2, 8, 8]
        h1_attn_transpose_4 = aten.transpose.int(h1_attn_matmul_1, 1, 2)  # h.1.attn  R  [2, 8, 2, 8]
        h1_attn_contiguous = aten.contiguous.default(h1_attn_transpose_4)  # h.1.attn  R  [2, 8, 2, 8]
        h1_attn_view_3 = aten.view.default(h1_attn_contiguous, [2, 8, 16])  # h.1.attn  R  [2, 8, 16]
        h1_attn_c_proj = aten.linear.default(  # h.1.attn.c_proj  R  [2, 8, 16]
            h1_attn_view_3, p_h_1_attn_c_proj_weight, p_h_1_attn_c_proj_bias)
        h1_attn_resid_dropout = aten.dropout.default(h1_attn_c_proj, 0.0, True)  # h.1.attn.resid_dropout  R  [2, 8, 16]
        h1_add = aten.add.Tensor(add_2, h1_attn_resid_dropout)  # h.1  R  [2, 8, 16]
        h1_ln_2 = aten.layer_norm.default(  # h.1.ln_2  R  [2, 8, 16]
            h1_add, [16], p_h_1_ln_2_weight, p_h_1_ln_2_bias, 1e-05, False)
        h1_mlp_c_fc = aten.linear.default(  # h.1.mlp.c_fc  R  [2, 8, 64]
            h1_ln_2, p_h_1_mlp_c_fc_weight, p_h_1_mlp_c_fc_bias)
        h1_mlp_gelu = aten.gelu.default(h1_mlp_c_fc)  # h.1.mlp  R  [2, 8, 64]
        h1_mlp_c_proj = aten.linear.default(  # h.1.mlp.c_proj  R  [2, 8, 16]
            h1_mlp_gelu, p_h_1_mlp_c_proj_weight, p_h_1_mlp_c_proj_bias)
        h1_mlp_dropout = aten.dropout.default(h1_mlp_c_proj, 0.0, True)  # h.1.mlp.dropout  R  [2, 8, 16]
        h1_add_1 = aten.add.Tensor(h1_add, h1_mlp_dropout)  # h.1  R  [2, 8, 16]
        ln_f = aten.layer_norm.default(h1_add_1, [16], p_ln_f_weight, p_ln_f_bias, 1e-05, False)  # ln_f  R  [2, 8, 16]
        lm_head = aten.linear.default(ln_f, p_wte_weight)  # lm_head  R  [2, 8, 32]
        reshape = aten.reshape.default(lm_head, [-1, 32])  # <top>  R  [16, 32]
        reshape_1 = aten.reshape.default(target, [-1])  # <top>  R  [16]  recomputed here
        cross_entropy_loss = aten.cross_entropy_loss.default(reshape, reshape_1)  # <top>  R  []
        return (cross_entropy_loss, )

    def model_outputs(self, add_2):
        p_wte_weight = self.p('wte.weight')
        p_h_1_ln_1_weight = self.p('h.1.ln_1.weight')
        p_h_1_ln_1_bias = self.p('h.1.ln_1.bias')
        p_h_1_attn_c_attn_weight = self.p('h.1.attn.c_attn.weight')
        p_h_1_attn_c_attn_bias = self.p('h.1.attn.c_attn.bias')
        p_h_1_attn_c_proj_weight = self.p('h.1.attn.c_proj.weight')
        p_h_1_attn_c_proj_bias = self.p('h.1.attn.c_proj.bias')
        p_h_1_ln_2_weight = self.p('h.1.ln_2.weight')
        p_h_1_ln_2_bias = self.p('h.1.ln_2.bias')
        p_h_1_mlp_c_fc_weight = self.p('h.1.mlp.c_fc.weight')
        p_h_1_mlp_c_fc_bias = self.p('h.1.mlp.c_fc.bias')
        p_h_1_mlp_c_proj_weight = self.p('h.1.mlp.c_proj.weight')
        p_h_1_mlp_c_proj_bias = self.p('h.1.mlp.c_proj.bias')
        p_ln_f_weight = self.p('ln_f.weight')
        p_ln_f_bias = self.p('ln_f.bias')
        p_h_1_attn_mask = self.p('h.1.attn.mask')
        h1_ln_1 = aten.layer_norm.default(  # h.1.ln_1  R  [2, 8, 16]
            add_2, [16], p_h_1_ln_1_weight, p_h_1_ln_1_bias, 1e-05, False)
        h1_attn_c_attn = aten.linear.default(  # h.1.attn.c_attn  R  [2, 8, 48]
            h1_ln_1, p_h_1_attn_c_attn_weight, p_h_1_attn_c_attn_bias)
        h1_attn_split = aten.split.Tensor(h1_attn_c_attn, 16, 2)  # h.1.attn  R  [2, 8, 16] x3
        h1_attn_split_0 = h1_attn_split[0]  # h.1.attn  R  [2, 8, 16]
        h1_attn_split_1 = h1_attn_split[1]  # h.1.attn  R  [2, 8, 16]
        h1_attn_split_2 = h1_attn_split[2]  # h.1.attn  R  [2, 8, 16]
        h1_attn_view = aten.view.default(h1_attn_split_0, [2, 8, 2, 8])  # h.1.attn  R  [2, 8, 2, 8]
        h1_attn_transpose = aten.transpose.int(h1_attn_view, 1, 2)  # h.1.attn  R  [2, 2, 8, 8]
        h1_attn_view_1 = aten.view.default(h1_attn_split_1, [2, 8, 2, 8])  # h.1.attn  R  [2, 8, 2, 8]
        h1_attn_transpose_1 = aten.transpose.int(h1_attn_view_1, 1, 2)  # h.1.attn  R  [2, 2, 8, 8]
        h1_attn_view_2 = aten.view.default(h1_attn_split_2, [2, 8, 2, 8])  # h.1.attn  R  [2, 8, 2, 8]
        h1_attn_transpose_2 = aten.transpose.int(h1_attn_view_2, 1, 2)  # h.1.attn  R  [2, 2, 8, 8]
        h1_attn_transpose_3 = aten.transpose.int(h1_attn_transpose_1, -2, -1)  # h.1.attn  R  [2, 2, 8, 8]
        h1_attn_matmul = aten.matmul.default(h1_attn_transpose, h1_attn_transpose_3)  # h.1.attn  R  [2, 2, 8, 8]
        h1_attn_mul = aten.mul.Tensor(h1_attn_matmul, 0.35355339059327373)  # h.1.attn  R  [2, 2, 8, 8]
        h1_attn_slice = aten.slice.Tensor(p_h_1_attn_mask, 2, 0, 8)  # h.1.attn  R  [1, 1, 8, 16]  recomputed here
        h1_attn_slice_1 = aten.slice.Tensor(h1_attn_slice, 3, 0, 8)  # h.1.attn  R  [1, 1, 8, 8]  recomputed here
        h1_attn_bitwise_not = aten.bitwise_not.default(h1_attn_slice_1)  # h.1.attn  R  [1, 1, 8, 8]  recomputed here
        h1_attn_masked_fill = aten.masked_fill.Scalar(  # h.1.attn  R  [2, 2, 8, 8]
            h1_attn_mul, h1_attn_bitwise_not, -float("inf"))
        h1_attn_softmax = aten.softmax.int(h1_attn_masked_fill, -1)  # h.1.attn  R  [2, 2, 8, 8]
        h1_attn_attn_dropout = aten.dropout.default(  # h.1.attn.attn_dropout  R  [2, 2, 8, 8]
            h1_attn_softmax, 0.0, True)
        h1_attn_matmul_1 = aten.matmul.default(h1_attn_attn_dropout, h1_attn_transpose_2)  # h.1.attn  R  [2, 2, 8, 8]
        h1_attn_transpose_4 = aten.transpose.int(h1_attn_matmul_1, 1, 2)  # h.1.attn  R  [2, 8, 2, 8]
        h1_attn_contiguous = aten.contiguous.default(h1_attn_transpose_4)  # h.1.attn  R  [2, 8, 2, 8]
        h1_attn_view_3 = aten.view.default(h1_attn_contiguous, [2, 8, 16])  # h.1.attn  R  [2, 8, 16]
        h1_attn_c_proj = aten.linear.default(  # h.1.attn.c_proj  R  [2, 8, 16]
            h1_attn_view_3, p_h_1_attn_c_proj_weight, p_h_1_attn_c_proj_bias)
        h1_attn_resid_dropout = aten.dropout.default(h1_attn_c_proj, 0.0, True)  # h.1.attn.resid_dropout  R  [2, 8, 16]
        h1_add = aten.add.Tensor(add_2, h1_attn_resid_dropout)  # h.1  R  [2, 8, 16]
        h1_ln_2 = aten.layer_norm.default(  # h.1.ln_2  R  [2, 8, 16]
            h1_add, [16], p_h_1_ln_2_weight, p_h_1_ln_2_bias, 1e-05, False)
        h1_mlp_c_fc = aten.linear.default(  # h.1.mlp.c_fc  R  [2, 8, 64]
            h1_ln_2, p_h_1_mlp_c_fc_weight, p_h_1_mlp_c_fc_bias)
        h1_mlp_gelu = aten.gelu.default(h1_mlp_c_fc)  # h.1.mlp  R  [2, 8, 64]
        h1_mlp_c_proj = aten.linear.default(  # h.1.mlp.c_proj  R  [2, 8, 16]
            h1_mlp_gelu, p_h_1_mlp_c_proj_weight, p_h_1_mlp_c_proj_bias)
        h1_mlp_dropout = aten.dropout.default(h1_mlp_c_proj, 0.0, True)  # h.1.mlp.dropout  R  [2, 8, 16]
        h1_add_1 = aten.add.Tensor(h1_add, h1_mlp_dropout)  # h.1  R  [2, 8, 16]
        ln_f = aten.layer_norm.default(h1_add_1, [16], p_ln_f_weight, p_ln_f_bias, 1e-05, False)  # ln_f  R  [2, 8, 16]
        lm_head = aten.linear.default(ln_f, p_wte_weight)  # lm_head  R  [2, 8, 32]
        return (lm_head, )
