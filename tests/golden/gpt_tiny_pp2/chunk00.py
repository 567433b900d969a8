"""threefold generated code for GPT: chunk 0 of 2.

plan:    tp=1,pp=2,dp=1,m=1,v=1,schedule=1f1b
rank:    pipeline stage 0 (model chunk 0, virtual 0), every tp rank of 1 (the tp rank is its tp group's, at run time)
covers:  wte, wpe, <top>, drop, h.0
Generated from the traced graph; edit the model, not this file.
"""
# content-hash: b76fce50ef12eb97
import torch

from threefold.runtime.module import ChunkModule

aten = torch.ops.aten


class Chunk0(ChunkModule):
    PARAMS = {
        'wte.weight': ([32, 16], 'float32'),
        'wpe.weight': ([16, 16], 'float32'),
        'h.0.ln_1.weight': ([16], 'float32'),
        'h.0.ln_1.bias': ([16], 'float32'),
        'h.0.attn.c_attn.weight': ([48, 16], 'float32'),
        'h.0.attn.c_attn.bias': ([48], 'float32'),
        'h.0.attn.c_proj.weight': ([16, 16], 'float32'),
        'h.0.attn.c_proj.bias': ([16], 'float32'),
        'h.0.ln_2.weight': ([16], 'float32'),
        'h.0.ln_2.bias': ([16], 'float32'),
        'h.0.mlp.c_fc.weight': ([64, 16], 'float32'),
        'h.0.mlp.c_fc.bias': ([64], 'float32'),
        'h.0.mlp.c_proj.weight': ([16, 64], 'float32'),
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
        arange = aten.arange.default(8, device=dev, pin_memory=False)  # recomputed here
        embedding = aten.embedding.default(p_wte_weight, idx)
        embedding_1 = aten.embedding.default(p_wpe_weight, arange)
        add = aten.add.Tensor(embedding, embedding_1)
        dropout = aten.dropout.default(add, 0.0, True)
        layer_norm = aten.layer_norm.default(dropout, [16], p_h_0_ln_1_weight, p_h_0_ln_1_bias, 1e-05, False)
        linear = aten.linear.default(layer_norm, p_h_0_attn_c_attn_weight, p_h_0_attn_c_attn_bias)
        split = aten.split.Tensor(linear, 16, 2)
        getitem = split[0]
        getitem_1 = split[1]
        getitem_2 = split[2]
        view = aten.view.default(getitem, [2, 8, 2, 8])
        transpose = aten.transpose.int(view, 1, 2)
        view_1 = aten.view.default(getitem_1, [2, 8, 2, 8])
        transpose_1 = aten.transpose.int(view_1, 1, 2)
        view_2 = aten.view.default(getitem_2, [2, 8, 2, 8])
        transpose_2 = aten.transpose.int(view_2, 1, 2)
        transpose_3 = aten.transpose.int(transpose_1, -2, -1)
        matmul = aten.matmul.default(transpose, transpose_3)
        mul = aten.mul.Tensor(matmul, 0.35355339059327373)
        slice_1 = aten.slice.Tensor(p_h_0_attn_mask, 2, 0, 8)  # recomputed here
        slice_2 = aten.slice.Tensor(slice_1, 3, 0, 8)  # recomputed here
        bitwise_not = aten.bitwise_not.default(slice_2)  # recomputed here
        masked_fill = aten.masked_fill.Scalar(mul, bitwise_not, -float("inf"))
        softmax = aten.softmax.int(masked_fill, -1)
        dropout_1 = aten.dropout.default(softmax, 0.0, True)
        matmul_1 = aten.matmul.default(dropout_1, transpose_2)
        transpose_4 = aten.transpose.int(matmul_1, 1, 2)
        contiguous = aten.contiguous.default(transpose_4)
        view_3 = aten.view.default(contiguous, [2, 8, 16])
        linear_1 = aten.linear.default(view_3, p_h_0_attn_c_proj_weight, p_h_0_attn_c_proj_bias)
        dropout_2 = aten.dropout.default(linear_1, 0.0, True)
        add_1 = aten.add.Tensor(dropout, dropout_2)
        layer_norm_1 = aten.layer_norm.default(add_1, [16], p_h_0_ln_2_weight, p_h_0_ln_2_bias, 1e-05, False)
        linear_2 = aten.linear.default(layer_norm_1, p_h_0_mlp_c_fc_weight, p_h_0_mlp_c_fc_bias)
        gelu = aten.gelu.default(linear_2)
        linear_3 = aten.linear.default(gelu, p_h_0_mlp_c_proj_weight, p_h_0_mlp_c_proj_bias)
        dropout_3 = aten.dropout.default(linear_3, 0.0, True)
        add_2 = aten.add.Tensor(add_1, dropout_3)
        return (add_2, )
