"""threefold generated code for GPT: chunk 1 of 2.

plan:    tp=1,pp=2,dp=1,m=1,v=1,schedule=1f1b
rank:    pipeline stage 1 (model chunk 1, virtual 0), every tp rank of 1 (the tp rank is its tp group's, at run time)
covers:  h.1, ln_f, lm_head, <top>
Generated from the traced graph; edit the model, not this file.
"""
# content-hash: 15fd8af14d2fc866
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
        layer_norm_2 = aten.layer_norm.default(add_2, [16], p_h_1_ln_1_weight, p_h_1_ln_1_bias, 1e-05, False)
        linear_4 = aten.linear.default(layer_norm_2, p_h_1_attn_c_attn_weight, p_h_1_attn_c_attn_bias)
        split_1 = aten.split.Tensor(linear_4, 16, 2)
        getitem_3 = split_1[0]
        getitem_4 = split_1[1]
        getitem_5 = split_1[2]
        view_4 = aten.view.default(getitem_3, [2, 8, 2, 8])
        transpose_5 = aten.transpose.int(view_4, 1, 2)
        view_5 = aten.view.default(getitem_4, [2, 8, 2, 8])
        transpose_6 = aten.transpose.int(view_5, 1, 2)
        view_6 = aten.view.default(getitem_5, [2, 8, 2, 8])
        transpose_7 = aten.transpose.int(view_6, 1, 2)
        transpose_8 = aten.transpose.int(transpose_6, -2, -1)
        matmul_2 = aten.matmul.default(transpose_5, transpose_8)
        mul_1 = aten.mul.Tensor(matmul_2, 0.35355339059327373)
        slice_3 = aten.slice.Tensor(p_h_1_attn_mask, 2, 0, 8)  # recomputed here
        slice_4 = aten.slice.Tensor(slice_3, 3, 0, 8)  # recomputed here
        bitwise_not_1 = aten.bitwise_not.default(slice_4)  # recomputed here
        masked_fill_1 = aten.masked_fill.Scalar(mul_1, bitwise_not_1, -float("inf"))
        softmax_1 = aten.softmax.int(masked_fill_1, -1)
        dropout_4 = aten.dropout.default(softmax_1, 0.0, True)
        matmul_3 = aten.matmul.default(dropout_4, transpose_7)
        transpose_9 = aten.transpose.int(matmul_3, 1, 2)
        contiguous_1 = aten.contiguous.default(transpose_9)
        view_7 = aten.view.default(contiguous_1, [2, 8, 16])
        linear_5 = aten.linear.default(view_7, p_h_1_attn_c_proj_weight, p_h_1_attn_c_proj_bias)
        dropout_5 = aten.dropout.default(linear_5, 0.0, True)
        add_3 = aten.add.Tensor(add_2, dropout_5)
        layer_norm_3 = aten.layer_norm.default(add_3, [16], p_h_1_ln_2_weight, p_h_1_ln_2_bias, 1e-05, False)
        linear_6 = aten.linear.default(layer_norm_3, p_h_1_mlp_c_fc_weight, p_h_1_mlp_c_fc_bias)
        gelu_1 = aten.gelu.default(linear_6)
        linear_7 = aten.linear.default(gelu_1, p_h_1_mlp_c_proj_weight, p_h_1_mlp_c_proj_bias)
        dropout_6 = aten.dropout.default(linear_7, 0.0, True)
        add_4 = aten.add.Tensor(add_3, dropout_6)
        layer_norm_4 = aten.layer_norm.default(add_4, [16], p_ln_f_weight, p_ln_f_bias, 1e-05, False)
        linear_8 = aten.linear.default(layer_norm_4, p_wte_weight)
        reshape = aten.reshape.default(linear_8, [-1, 32])
        reshape_1 = aten.reshape.default(target, [-1])  # recomputed here
        cross_entropy_loss = aten.cross_entropy_loss.default(reshape, reshape_1)
        return (cross_entropy_loss, )
