"""Explanations of each walkthrough step, in English and Traditional Chinese.

Messages are format strings; every number in them is filled in from a trace by the
caller, never typed in here. Chinese follows Taiwan usage and the seed text's terms
(注意力分數, 注意力權重, 上下文向量, 查詢/鍵/值); 列 is a row, 行 a column.
"""

from __future__ import annotations

__all__ = ["DEFAULT_LANG", "LANGS", "MESSAGES", "message", "normalize_lang"]

LANGS: tuple[str, ...] = ("en", "zh-TW")
DEFAULT_LANG = "en"

_ALIASES = {"en": "en", "zh-tw": "zh-TW", "zh_tw": "zh-TW", "zh-hant": "zh-TW"}

# key -> {lang: format string}
MESSAGES: dict[str, dict[str, str]] = {
    "header": {
        "en": "Self-attention, step by step: example {example!r}, {n} tokens, d_in = {d_in}",
        "zh-TW": "自注意力機制逐步解說：範例 {example!r}，{n} 個詞元（token），d_in = {d_in}",
    },
    "example.journey": {
        "en": 'The book\'s six tokens "Your journey starts with one step", each a 3-d embedding.',
        "zh-TW": "書中的六個詞元「Your journey starts with one step」，每個是 3 維嵌入向量。",
    },
    "example.toy": {
        "en": "The seed text's 2-D toy: six 2-d inputs and explicit 2x2 matrices W_q, W_k, W_v.",
        "zh-TW": "原文中的二維小例子：六個 2 維輸入，以及明確給定的 2x2 矩陣 W_q、W_k、W_v。",
    },
    "example.custom": {
        "en": "User-supplied inputs.",
        "zh-TW": "使用者提供的輸入。",
    },
    "part.simplified": {
        "en": "Part 1 · Simplified self-attention (section 3.3): no trainable weights",
        "zh-TW": "第一部分 · 簡化的自注意力機制（3.3 節）：沒有可訓練權重",
    },
    "part.trainable": {
        "en": "Part 2 · Self-attention with trainable weights (section 3.4), "
        "walked through for token {pos} ({token!r})",
        "zh-TW": "第二部分 · 具可訓練權重的自注意力機制（3.4 節），"
        "以第 {pos} 個詞元（{token!r}）逐步示範",
    },
    "part.modules": {
        "en": "Part 3 · The same computation as PyTorch modules",
        "zh-TW": "第三部分 · 以 PyTorch 模組完成同樣的計算",
    },
    "inputs.title": {
        "en": "Input embeddings X ({n}×{d_in})",
        "zh-TW": "輸入嵌入向量 X（{n}×{d_in}）",
    },
    "inputs.text": {
        "en": "Each row is one token's embedding. In the simplified form every embedding "
        "serves as its own query, key and value.",
        "zh-TW": "每一列是一個詞元的嵌入向量。"
        "在簡化形式中，每個嵌入向量同時充當自己的查詢、鍵和值。",
    },
    "scores.title": {
        "en": "Attention scores ω = X·Xᵀ ({n}×{n})",
        "zh-TW": "注意力分數 ω = X·Xᵀ（{n}×{n}）",
    },
    "scores.text": {
        "en": "Entry (i, j) is the dot product of token i's embedding with token j's: large "
        "when the two are long and point the same way. Row i holds token i's scores "
        "against every token.",
        "zh-TW": "第 (i, j) 個元素是詞元 i 與詞元 j 嵌入向量的點積："
        "兩者越長、方向越接近，數值越大。第 i 列是詞元 i 對所有詞元的分數。",
    },
    "weights.title": {
        "en": "Attention weights = softmax(ω, dim=-1) ({n}×{n}), with row sums",
        "zh-TW": "注意力權重 = softmax(ω, dim=-1)（{n}×{n}），附每列總和",
    },
    "weights.text": {
        "en": "dim=-1 applies the softmax along the last dimension, across the columns of "
        "each row, so each token's weights over all tokens are positive and sum to 1; the "
        "last column checks it.",
        "zh-TW": "dim=-1 表示沿著最後一個維度做 softmax，也就是在每一列中橫跨各行歸一化，"
        "因此每個詞元對所有詞元的權重皆為正數且加總為 1；最後一行即為驗證。",
    },
    "context.title": {
        "en": "Context vectors Z = weights·X ({n}×{d})",
        "zh-TW": "上下文向量 Z = 權重·X（{n}×{d}）",
    },
    "context.text": {
        "en": "Each context vector is a weighted average of all the embeddings, with that "
        "token's row of weights: token i's summary of the whole sequence.",
        "zh-TW": "每個上下文向量都是所有嵌入向量的加權平均，權重取自該詞元那一列："
        "也就是詞元 i 對整個序列的摘要。",
    },
    "matrices.title": {
        "en": "Trainable matrices W_query, W_key, W_value ({rows}×{cols} each)",
        "zh-TW": "可訓練的權重矩陣 W_query、W_key、W_value（各為 {rows}×{cols}）",
    },
    "matrices.seeded": {
        "en": "Drawn with torch.rand after torch.manual_seed({seed}), in the order W_query, "
        "W_key, W_value, as the book does. Each has shape (d_in, d_out) and projects as "
        "x @ W; training would update them.",
        "zh-TW": "依照書中做法，在 torch.manual_seed({seed}) 之後以 torch.rand 依序產生 "
        "W_query、W_key、W_value。每個矩陣的形狀為 (d_in, d_out)，投影方式為 x @ W；"
        "訓練時會更新這些權重。",
    },
    "matrices.explicit": {
        "en": "The toy's explicit matrices in the nn.Linear convention: each has shape "
        "(d_out, d_in) and projects as inputs @ W.T (not x @ W).",
        "zh-TW": "小例子中明確給定的矩陣，採用 nn.Linear 的慣例：每個矩陣的形狀為 "
        "(d_out, d_in)，投影方式為 inputs @ W.T（而非 x @ W）。",
    },
    "token_qkv.title": {
        "en": "Token {pos} ({token!r}) projected: query_{pos}, key_{pos}, value_{pos}",
        "zh-TW": "投影第 {pos} 個詞元（{token!r}）：query_{pos}、key_{pos}、value_{pos}",
    },
    "token_qkv.text": {
        "en": "The token's embedding is projected into a query (what it looks for), a key "
        "(what it is matched on) and a value (what it passes on).",
        "zh-TW": "把詞元的嵌入向量投影成查詢（它要找什麼）、"
        "鍵（用來被比對的依據）和值（它實際傳遞的內容）。",
    },
    "keys_values.title": {
        "en": "Keys and values of all tokens ({n}×{d} each)",
        "zh-TW": "所有詞元的鍵與值（各為 {n}×{d}）",
    },
    "keys_values.text": {
        "en": "To attend, token {pos} needs every token's key and value: "
        "keys = inputs {op_k}, values = inputs {op_v}.",
        "zh-TW": "為了計算注意力，第 {pos} 個詞元需要所有詞元的鍵和值："
        "keys = inputs {op_k}，values = inputs {op_v}。",
    },
    "score_self.title": {
        "en": "attn_score_{pos}{pos} = query_{pos} · key_{pos}",
        "zh-TW": "attn_score_{pos}{pos} = query_{pos} · key_{pos}",
    },
    "score_self.text": {
        "en": "The score of token {pos} with itself: the dot product of its query with its "
        "own key. (The seed's code calls an undefined keys_2 here; it means key_2.)",
        "zh-TW": "第 {pos} 個詞元對自己的分數：它的查詢向量與自己的鍵向量的點積。"
        "（原文程式碼在此寫成未定義的 keys_2，應為 key_2。）",
    },
    "token_scores.title": {
        "en": "attn_scores_{pos} = query_{pos} @ keys.T ({n},)",
        "zh-TW": "attn_scores_{pos} = query_{pos} @ keys.T（{n},）",
    },
    "token_scores.text": {
        "en": "One dot product per key; entry {pos} is the score above.",
        "zh-TW": "每個鍵各一個點積；第 {pos} 個元素就是上面的分數。",
    },
    "token_weights.title": {
        "en": "attn_weights_{pos} = softmax(attn_scores_{pos} / √d_k, dim=-1), d_k = {d_k}",
        "zh-TW": "attn_weights_{pos} = softmax(attn_scores_{pos} / √d_k, dim=-1)，d_k = {d_k}",
    },
    "token_weights.text": {
        "en": "The scores are divided by √d_k = {sqrt_dk:.4f} before the softmax. Dot "
        "products grow with the dimension; large scores push the softmax towards one-hot, "
        "where its gradients are tiny and training stalls.",
        "zh-TW": "在 softmax 之前先把分數除以 √d_k = {sqrt_dk:.4f}。點積會隨維度增大；"
        "分數過大時 softmax 會趨近 one-hot，梯度變得極小，訓練因而停滯。",
    },
    "token_context.title": {
        "en": "context_vec_{pos} = attn_weights_{pos} @ values ({d},)",
        "zh-TW": "context_vec_{pos} = attn_weights_{pos} @ values（{d},）",
    },
    "token_context.text": {
        "en": "The context vector is the sum of the value vectors weighted by attention. "
        "(The seed text omits this code; it is this one line.)",
        "zh-TW": "上下文向量是以注意力權重對值向量加權求和的結果。"
        "（原文省略了這段程式碼，其實就是這一行。）",
    },
    "all.title": {
        "en": "All tokens at once: softmax(Q·Kᵀ/√d_k, dim=-1) ({n}×{n}) and context = weights·V",
        "zh-TW": "一次計算所有詞元：softmax(Q·Kᵀ/√d_k, dim=-1)（{n}×{n}）與上下文 = 權重·V",
    },
    "all.text": {
        "en": "The same steps as matrix products for every token. Row {pos} repeats the "
        "single-token walk: max |difference| = {diff:.1e}.",
        "zh-TW": "以矩陣乘法對所有詞元做同樣的步驟。第 {pos} 列與上面的單一詞元計算相同："
        "最大絕對差 = {diff:.1e}。",
    },
    "v1.text.seeded": {
        "en": "Its three nn.Parameter(torch.rand(d_in, d_out)) are drawn in the walk's "
        "order, so after the same seed it holds the same matrices: row {pos} is "
        "context_vec_{pos} (max |difference| = {diff:.1e}).",
        "zh-TW": "它的三個 nn.Parameter(torch.rand(d_in, d_out)) 與逐步計算的產生順序相同，"
        "因此在相同的種子下權重完全一樣："
        "第 {pos} 列就是 context_vec_{pos}（最大絕對差 = {diff:.1e}）。",
    },
    "v2.text.seeded": {
        "en": "nn.Linear computes x @ weight.T and starts from a better initialisation, so "
        "these numbers differ from V1's: different weights, the same computation.",
        "zh-TW": "nn.Linear 計算 x @ weight.T，並採用較佳的權重初始化方式，所以數值與 V1 不同："
        "權重不同，計算方式相同。",
    },
    "v2.text.explicit": {
        "en": "The toy's matrices loaded as nn.Linear weights: its output is the context "
        "vectors of the walk above (max |difference| = {diff:.1e}).",
        "zh-TW": "把小例子的矩陣載入為 nn.Linear 的權重：輸出就是上面逐步計算的上下文向量"
        "（最大絕對差 = {diff:.1e}）。",
    },
    "copy.text": {
        "en": "Copying each nn.Linear weight, transposed (W = weight.T), into a V1 makes V1 "
        "compute what V2 computes: max |difference| = {diff:.1e}.",
        "zh-TW": "把每個 nn.Linear 權重轉置後（W = weight.T）複製進 V1，V1 的輸出便與 V2 相同："
        "最大絕對差 = {diff:.1e}。",
    },
    "label.token": {"en": "token", "zh-TW": "詞元"},
    "label.row_sum": {"en": "row sum", "zh-TW": "列總和"},
    "label.value": {"en": "value", "zh-TW": "數值"},
    "label.vector": {"en": "vector", "zh-TW": "向量"},
    "label.wrote": {"en": "Figures written:", "zh-TW": "已輸出圖檔："},
    # attnlab explain
    "explain.summary": {
        "en": "{source}: {n} tokens, {layers} layers x {heads} heads ({mode})",
        "zh-TW": "{source}：{n} 個詞元，{layers} 層 x {heads} 個注意力頭（{mode}）",
    },
    "explain.dense": {"en": "all weights", "zh-TW": "全部權重"},
    "explain.topk": {
        "en": "the {k} strongest keys of each query",
        "zh-TW": "每個查詢最強的 {k} 個鍵",
    },
    "explain.weights": {
        "en": "Attention weights of {layer}, head {head} (rows: queries, columns: keys)",
        "zh-TW": "{layer}、第 {head} 個頭的注意力權重（列：查詢，行：鍵）",
    },
    "explain.top": {
        "en": "Strongest keys of each query, {layer}, head {head}",
        "zh-TW": "{layer}、第 {head} 個頭：每個查詢最強的鍵",
    },
    "explain.more": {
        "en": "... {n} more queries in the page",
        "zh-TW": "……其餘 {n} 個查詢請見網頁",
    },
    "explain.experts": {
        "en": "Experts of layer {layer} (top {k} of {n}): where the router sent each token, "
        "with its weight",
        "zh-TW": "第 {layer} 層的專家（{n} 個中選 {k} 個）：路由器把每個詞元送到哪些專家，以及權重",
    },
    "explain.experts_shared": {
        "en": "every token also runs the shared expert",
        "zh-TW": "每個詞元也都會經過共享專家",
    },
    "explain.expert": {"en": "expert", "zh-TW": "專家"},
    "explain.page": {
        "en": "Interactive page (open it in a browser, works offline): {path}",
        "zh-TW": "互動網頁（以瀏覽器開啟，可離線使用）：{path}",
    },
    # figure text (attnlab.explain.figures, with a CJK font for zh-TW)
    "fig.key_axis": {"en": "key (token attended to)", "zh-TW": "鍵（被注意的詞元）"},
    "fig.query_axis": {"en": "query (token attending)", "zh-TW": "查詢（發出注意的詞元）"},
    "fig.weight_bar": {"en": "weight (each row sums to 1)", "zh-TW": "權重（每列總和為 1）"},
    "fig.weights": {"en": "Attention weights", "zh-TW": "注意力權重"},
    "fig.head": {"en": "head {h}", "zh-TW": "第 {h} 個頭"},
    "fig.layer": {"en": "layer {i}", "zh-TW": "第 {i} 層"},
    "fig.layer_head": {"en": "{layer}, head {h}", "zh-TW": "{layer}、第 {h} 個頭"},
    "fig.query": {"en": "query", "zh-TW": "查詢"},
    "fig.key": {"en": "key", "zh-TW": "鍵"},
    "fig.heads_title": {"en": "{layer}, {n} tokens", "zh-TW": "{layer}，{n} 個詞元"},
    "fig.model_title": {
        "en": "attention weights, {L} layers x {H} heads, {n} tokens",
        "zh-TW": "注意力權重，{L} 層 x {H} 個頭，{n} 個詞元",
    },
    "fig.simplified": {
        "en": "Simplified attention weights: softmax(X·Xᵀ, dim=-1)",
        "zh-TW": "簡化的注意力權重：softmax(X·Xᵀ, dim=-1)",
    },
    "fig.trainable": {
        "en": "Trainable attention weights: softmax(Q·Kᵀ / √d_k, dim=-1), d_k = {d_k}",
        "zh-TW": "具可訓練權重的注意力權重：softmax(Q·Kᵀ / √d_k, dim=-1)，d_k = {d_k}",
    },
    "fig.flow_example": {
        "en": "Scaled dot-product self-attention: example '{example}', T = {n} tokens, "
        "d_in = {d_in}, d_out = {d}",
        "zh-TW": "縮放點積自注意力：範例「{example}」，T = {n} 個詞元，d_in = {d_in}，d_out = {d}",
    },
    "fig.flow_layer": {
        "en": "Attention layer: B = {B}, T = {T} tokens, width C = {C}, head dim D = {D}",
        "zh-TW": "注意力層：B = {B}，T = {T} 個詞元，寬度 C = {C}，頭維度 D = {D}",
    },
    "fig.inputs": {"en": "inputs X", "zh-TW": "輸入 X"},
    "fig.queries": {"en": "queries Q", "zh-TW": "查詢 Q"},
    "fig.keys": {"en": "keys K", "zh-TW": "鍵 K"},
    "fig.values": {"en": "values V", "zh-TW": "值 V"},
    "fig.scores": {"en": "scores", "zh-TW": "分數"},
    "fig.weights_a": {"en": "weights A", "zh-TW": "權重 A"},
    "fig.rows_sum": {"en": "rows sum to 1", "zh-TW": "每列總和為 1"},
    "fig.context_z": {"en": "context Z", "zh-TW": "上下文 Z"},
    "fig.tensor": {"en": "tensor (shape)", "zh-TW": "張量（形狀）"},
    "fig.operation": {"en": "operation (output shape)", "zh-TW": "運算（輸出形狀）"},
    # step into a head (attnlab explain --steps, the server's step view)
    "step.header": {
        "en": "Step into {source}: layer {layer}, head {head}, query token {pos} ({token!r}) "
        "of {n}",
        "zh-TW": "走進 {source}：第 {layer} 層、第 {head} 個頭，查詢詞元 {pos}（{token!r}），"
        "共 {n} 個詞元",
    },
    "step.input.title": {
        "en": "x_{pos}: the layer's input for token {pos} ({c},)",
        "zh-TW": "x_{pos}：這一層對詞元 {pos} 的輸入（{c},）",
    },
    "step.input.text": {
        "en": "The token's vector as it enters this attention layer: its embedding after "
        "the layers before and this block's normalisation.",
        "zh-TW": "詞元進入這個注意力層時的向量：經過前面各層與本區塊的正規化之後的嵌入向量。",
    },
    "step.query.title": {
        "en": "query_{pos} = x_{pos} @ W_query.T, head {head} ({d},)",
        "zh-TW": "query_{pos} = x_{pos} @ W_query.T，第 {head} 個頭（{d},）",
    },
    "step.query.text": {
        "en": "The head's slice of the query projection: what token {pos} looks for.",
        "zh-TW": "查詢投影中屬於這個頭的部分：詞元 {pos} 要找什麼。",
    },
    "step.rope.title": {
        "en": "query_{pos} after RoPE (position {pos})",
        "zh-TW": "經過 RoPE 旋轉後的 query_{pos}（位置 {pos}）",
    },
    "step.rope.text": {
        "en": "Rotary position embedding turns each pair of dimensions by an angle that "
        "grows with the position; the keys are turned the same way, so a dot product "
        "depends on how far apart two tokens are.",
        "zh-TW": "旋轉位置嵌入（RoPE）把每一對維度旋轉一個隨位置增大的角度；"
        "鍵也以同樣方式旋轉，因此點積取決於兩個詞元相隔多遠。",
    },
    "step.qknorm.title": {
        "en": "query_{pos} after QK-norm",
        "zh-TW": "經過 QK 正規化後的 query_{pos}",
    },
    "step.qknorm_rope.title": {
        "en": "query_{pos} after QK-norm and RoPE (position {pos})",
        "zh-TW": "經過 QK 正規化與 RoPE 旋轉後的 query_{pos}（位置 {pos}）",
    },
    "step.qknorm.text": {
        "en": "QK-norm (Qwen3, Gemma 3, OLMo 2) normalises the query (and every key) with "
        "learned weights, which keeps the dot products in range.",
        "zh-TW": "QK 正規化（Qwen3、Gemma 3、OLMo 2）以學習到的權重把查詢（以及每個鍵）正規化，"
        "讓點積保持在合理範圍。",
    },
    "step.keys.title": {
        "en": "keys = x @ W_key.T of all {n} tokens, key head {kv} ({n}×{d})",
        "zh-TW": "所有 {n} 個詞元的鍵 keys = x @ W_key.T，鍵頭 {kv}（{n}×{d}）",
    },
    "step.keys.text": {
        "en": "One key per token: what each token is matched on.",
        "zh-TW": "每個詞元一個鍵：用來被比對的依據。",
    },
    "step.keys.rope": {
        "en": "One key per token: what each token is matched on (rotated by RoPE like the query).",
        "zh-TW": "每個詞元一個鍵：用來被比對的依據（與查詢一樣經過 RoPE 旋轉）。",
    },
    "step.keys.gqa": {
        "en": "Grouped-query attention: {share} query heads share this key/value head.",
        "zh-TW": "分組查詢注意力：{share} 個查詢頭共用這個鍵／值頭。",
    },
    # multi-head latent attention (DeepSeek-V2/V3, Kimi K2): the walk through the latent
    "step.mla.q_down.title": {
        "en": "q_a_{pos} = RMSNorm(x_{pos} @ W_dq.T) ({q},)",
        "zh-TW": "q_a_{pos} = RMSNorm(x_{pos} @ W_dq.T)（{q},）",
    },
    "step.mla.q_down.text": {
        "en": "The query goes through a low-rank pair: x_{pos} is projected down to {q} dims "
        "(first table) and normalised by an RMSNorm (second table); W_uq then projects it up "
        "to every head's query.",
        "zh-TW": "查詢先經過一對低秩投影：x_{pos} 先降到 {q} 維（第一個表），再經 RMSNorm "
        "正規化（第二個表）；之後 W_uq 再把它升到每個頭的查詢。",
    },
    "step.mla.query.title": {
        "en": "query_{pos} = {src} @ {w}.T, head {head}: q_nope ({dn},) and q_rope ({dr},)",
        "zh-TW": "query_{pos} = {src} @ {w}.T，第 {head} 個頭：q_nope（{dn},）與 q_rope（{dr},）",
    },
    "step.mla.query.text": {
        "en": "The head's query has two parts: {dn} dims without position (q_nope), matched "
        "against keys rebuilt from the latent, and {dr} dims (q_rope) that RoPE rotates.",
        "zh-TW": "這個頭的查詢分成兩部分：{dn} 個不含位置的維度（q_nope），用來與由潛在向量"
        "重建的鍵比對；以及 {dr} 個會被 RoPE 旋轉的維度（q_rope）。",
    },
    "step.mla.rope.title": {
        "en": "q_rope_{pos} after RoPE (position {pos}); query_{pos} = [q_nope, q_rope] ({d},)",
        "zh-TW": "經過 RoPE 旋轉後的 q_rope_{pos}（位置 {pos}）；"
        "query_{pos} = [q_nope, q_rope]（{d},）",
    },
    "step.mla.rope.text": {
        "en": "RoPE turns only the {dr} rotary dims, each pair by an angle that grows with "
        "the position (the shared rotary key is turned the same way, so their dot product "
        "depends on how far apart two tokens are); the {dn} nope dims stay as they are (the "
        "second table is the whole query).",
        "zh-TW": "RoPE 只旋轉 {dr} 個旋轉維度，每一對維度轉動一個隨位置增大的角度（共用的旋轉鍵"
        "也以同樣方式旋轉，因此兩者的點積取決於兩個詞元相隔多遠）；{dn} 個 nope 維度保持不變"
        "（第二個表是完整的查詢）。",
    },
    "step.mla.latent.title": {
        "en": "c_kv = RMSNorm(x @ W_dkv.T) of all {n} tokens: the latent ({n}×{r})",
        "zh-TW": "所有 {n} 個詞元的 c_kv = RMSNorm(x @ W_dkv.T)：潛在向量（{n}×{r}）",
    },
    "step.mla.latent.text": {
        "en": "Latent attention caches one latent per token, shared by every head: the input "
        "is projected down to {r} dims (first table) and normalised by an RMSNorm (second "
        "table). With the {dr}-dim rotary key of the next step, that is all the cache holds "
        "for a token.",
        "zh-TW": "潛在注意力為每個詞元只快取一個潛在向量，所有頭共用：輸入先降到 {r} 維"
        "（第一個表），再經 RMSNorm 正規化（第二個表）。加上下一步的 {dr} 維旋轉鍵，"
        "這就是快取為每個詞元保存的全部內容。",
    },
    "step.mla.k_rope.title": {
        "en": "k_rope = RoPE(last {dr} dims of x @ W_dkv.T) of all {n} tokens, shared by "
        "every head ({n}×{dr})",
        "zh-TW": "所有 {n} 個詞元的 k_rope = RoPE(x @ W_dkv.T 的最後 {dr} 維)，所有頭共用"
        "（{n}×{dr}）",
    },
    "step.mla.k_rope.text": {
        "en": "The same down-projection gives each token {dr} more dims: one rotary key for "
        "all heads, turned by RoPE at the token's position (first table before, second "
        "after; the cache keeps it turned).",
        "zh-TW": "同一個降維投影還為每個詞元多產生 {dr} 維：所有頭共用的一個旋轉鍵，依詞元的"
        "位置以 RoPE 旋轉（第一個表為旋轉前，第二個表為旋轉後；快取保存旋轉後的結果）。",
    },
    "step.mla.k_nope.title": {
        "en": "k_nope = c_kv @ W_uk.T of all {n} tokens, head {head} ({n}×{dn})",
        "zh-TW": "所有 {n} 個詞元的 k_nope = c_kv @ W_uk.T，第 {head} 個頭（{n}×{dn}）",
    },
    "step.mla.k_nope.text": {
        "en": "The head's own up-projection W_uk expands every token's latent into the "
        "position-free part of its key. (For one new token the layer can fold W_uk into "
        "the query instead and never build these keys; the scores are the same.)",
        "zh-TW": "這個頭自己的上投影 W_uk 把每個詞元的潛在向量展開成鍵中不含位置的部分。"
        "（只有一個新詞元時，這一層可以改把 W_uk 併入查詢，完全不建構這些鍵；分數相同。）",
    },
    "step.mla.keys.title": {
        "en": "keys = [k_nope, k_rope] of all {n} tokens, head {head} ({n}×{d})",
        "zh-TW": "所有 {n} 個詞元的鍵 keys = [k_nope, k_rope]，第 {head} 個頭（{n}×{d}）",
    },
    "step.mla.keys.text": {
        "en": "A key is the head's k_nope ({dn} dims) followed by the shared rotary key "
        "({dr} dims). The query, keys and values rebuilt here from the latent are the ones "
        "the layer attended with (max |difference| = {diff:.1e}).",
        "zh-TW": "鍵是這個頭的 k_nope（{dn} 維）接上共用的旋轉鍵（{dr} 維）。這裡由潛在向量"
        "重建的查詢、鍵和值，與這一層實際使用的相同（最大絕對差 = {diff:.1e}）。",
    },
    "step.scores.title": {
        "en": "attn_scores_{pos} = query_{pos} @ keys.T ({n},)",
        "zh-TW": "attn_scores_{pos} = query_{pos} @ keys.T（{n},）",
    },
    "step.scores.text": {
        "en": "One dot product per key: large when the key points the same way as the query.",
        "zh-TW": "每個鍵各一個點積：鍵與查詢方向越接近，數值越大。",
    },
    "step.scale.title": {
        "en": "scaled = attn_scores_{pos} × {scale:.4f} (= 1/√d_k, d_k = {d})",
        "zh-TW": "scaled = attn_scores_{pos} × {scale:.4f}（= 1/√d_k，d_k = {d}）",
    },
    "step.scale.other_title": {
        "en": "scaled = attn_scores_{pos} × {scale:.4f} (the model's own score scale)",
        "zh-TW": "scaled = attn_scores_{pos} × {scale:.4f}（模型自己的分數縮放）",
    },
    "step.scale.other": {
        "en": "This model scales its scores by its own factor, not by 1/√d_k = {usual:.4f} "
        "(d_k = {d}): its configuration sets it (a query scalar, a multiplier or a RoPE "
        "scaling's correction).",
        "zh-TW": "這個模型用自己的係數縮放分數，而不是 1/√d_k = {usual:.4f}（d_k = {d}）："
        "由設定決定（查詢縮放值、乘數或 RoPE 縮放的修正）。",
    },
    "step.scale.text": {
        "en": "The scores are divided by √d_k = {sqrt_dk:.4f} before the softmax. Dot "
        "products grow with the dimension; large scores push the softmax towards one-hot.",
        "zh-TW": "在 softmax 之前先把分數除以 √d_k = {sqrt_dk:.4f}。點積會隨維度增大；"
        "分數過大時 softmax 會趨近 one-hot。",
    },
    "step.softcap.title": {
        "en": "capped = {c} · tanh(scaled / {c}) ({n},)",
        "zh-TW": "capped = {c} · tanh(scaled / {c})（{n},）",
    },
    "step.softcap.text": {
        "en": "Logit soft-capping (Gemma 2) squeezes the scaled scores smoothly into "
        "(−{c}, {c}) so that no score can run away.".replace("{c}", "c"),
        "zh-TW": "對數軟上限（Gemma 2）把縮放後的分數平滑地壓進 (−c, c)，避免分數失控。",
    },
    "step.sink": {
        "en": "This head has an attention sink (logit {sink:.4f}): one more softmax column "
        "with no value, which took {mass:.4f} of the weight, so the keys' weights sum to "
        "less than 1.",
        "zh-TW": "這個頭有注意力匯點（logit {sink:.4f}）：softmax 多一行但沒有值，"
        "它拿走了 {mass:.4f} 的權重，因此各鍵的權重總和小於 1。",
    },
    "step.bias.title": {
        "en": "+ position bias ({n},)",
        "zh-TW": "加上位置偏差（{n},）",
    },
    "step.bias.text": {
        "en": "This model adds a bias to the scaled scores (ALiBi or relative position).",
        "zh-TW": "這個模型會在縮放後的分數上加一個偏差（ALiBi 或相對位置）。",
    },
    "step.mask.title": {
        "en": "mask: {hidden} of {n} keys hidden (−inf)",
        "zh-TW": "遮罩：{n} 個鍵中有 {hidden} 個被遮住（−inf）",
    },
    "step.mask.text": {
        "en": "Keys the query may not see get −inf, so the softmax gives them weight 0 "
        "(a causal model hides the tokens after the query).",
        "zh-TW": "查詢不能看到的鍵設為 −inf，softmax 後權重為 0（因果模型會遮住查詢之後的詞元）。",
    },
    "step.weights.title": {
        "en": "attn_weights_{pos} = softmax(…, dim=-1) ({n},), sum = {total:.4f}",
        "zh-TW": "attn_weights_{pos} = softmax(…, dim=-1)（{n},），總和 = {total:.4f}",
    },
    "step.weights.text": {
        "en": "The weights are positive and sum to 1. They are the head view's weights: the "
        "layer itself computed them (max |difference| = {diff:.1e}).",
        "zh-TW": "權重皆為正數且加總為 1，與注意力頭視圖中的權重相同："
        "由這一層自己計算（最大絕對差 = {diff:.1e}）。",
    },
    "step.values.title": {
        "en": "values = x @ W_value.T of all {n} tokens ({n}×{d})",
        "zh-TW": "所有 {n} 個詞元的值 values = x @ W_value.T（{n}×{d}）",
    },
    "step.values.latent_title": {
        "en": "values = c_kv @ W_uv.T of all {n} tokens, head {head} ({n}×{d})",
        "zh-TW": "所有 {n} 個詞元的值 values = c_kv @ W_uv.T，第 {head} 個頭（{n}×{d}）",
    },
    "step.values.latent": {
        "en": "The head's own up-projection W_uv expands every token's latent into its "
        "value: what the token passes on.",
        "zh-TW": "這個頭自己的上投影 W_uv 把每個詞元的潛在向量展開成它的值：它實際傳遞的內容。",
    },
    "step.values.text": {
        "en": "One value per token: what each token passes on.",
        "zh-TW": "每個詞元一個值：它實際傳遞的內容。",
    },
    "step.context.title": {
        "en": "context_vec_{pos} = attn_weights_{pos} @ values ({d},)",
        "zh-TW": "context_vec_{pos} = attn_weights_{pos} @ values（{d},）",
    },
    "step.context.text": {
        "en": "The sum of the value vectors weighted by attention: this head's output for "
        "token {pos} (the layer's own: max |difference| = {diff:.1e}).",
        "zh-TW": "以注意力權重對值向量加權求和：這個頭對詞元 {pos} 的輸出"
        "（與這一層自己的結果相同：最大絕對差 = {diff:.1e}）。",
    },
    "step.out.title": {
        "en": "output_{pos} = out_proj(context of all {h} heads) ({c},)",
        "zh-TW": "output_{pos} = out_proj（全部 {h} 個頭的上下文向量）（{c},）",
    },
    "step.out.text": {
        "en": "The output projection mixes the heads: this head's share is context_vec_{pos} "
        "@ W_o[:, head {head}].T (first row); the layer's output adds every head's share "
        "and the bias (second row; max |difference| = {diff:.1e}).",
        "zh-TW": "輸出投影把各個頭混合起來：這個頭的貢獻是 context_vec_{pos} @ "
        "W_o[:, 第 {head} 個頭].T（第一列）；這一層的輸出是所有頭的貢獻加上偏差"
        "（第二列；最大絕對差 = {diff:.1e}）。",
    },
    "step.more": {
        "en": "{n} of {total} shown",
        "zh-TW": "顯示 {total} 個中的 {n} 個",
    },
    "label.head_share": {"en": "this head's share", "zh-TW": "這個頭的貢獻"},
    "label.output": {"en": "layer output", "zh-TW": "層的輸出"},
    "label.before_rope": {"en": "before RoPE", "zh-TW": "RoPE 之前"},
    "label.after_rope": {"en": "after RoPE", "zh-TW": "RoPE 之後"},
}


def normalize_lang(lang: str) -> str:
    """The canonical language code for ``lang`` (case and ``_``/``-`` forgiving).

    Args:
        lang: ``"en"`` or ``"zh-TW"`` (also ``"zh_tw"``, ``"zh-Hant"``).

    Returns:
        ``"en"`` or ``"zh-TW"``.

    Raises:
        TypeError: ``lang`` is not a string.
        ValueError: an unsupported language.
    """
    if not isinstance(lang, str):
        raise TypeError(f"`lang` must be a str, got {type(lang).__name__}")
    try:
        return _ALIASES[lang.strip().lower()]
    except KeyError:
        raise ValueError(f"`lang` must be one of {', '.join(LANGS)}; got {lang!r}") from None


def message(key: str, lang: str = DEFAULT_LANG, **values: object) -> str:
    """The message ``key`` in ``lang``, formatted with ``values``.

    Raises:
        KeyError: an unknown key.
        ValueError: an unsupported language.
    """
    return MESSAGES[key][normalize_lang(lang)].format(**values)
