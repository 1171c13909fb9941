#include "train/step_simulator.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace moe {
namespace {

double d(int64_t x) { return static_cast<double>(x); }

int64_t moe_layers(const ModelConfig& mc) {
  return mc.moe.n_experts > 0 ? mc.n_layers - std::min(mc.first_dense_layers, mc.n_layers) : 0;
}

double phase(const ComputeProfile& p, const char* name) {
  const auto it = p.phase_ms.find(name);
  return it == p.phase_ms.end() ? 0.0 : it->second;
}

// ms per unit, or `fallback` when the profile has no such work.
double per_unit(double ms, double units, double fallback) { return units > 0 && ms > 0 ? ms / units : fallback; }

}  // namespace

StepWork micro_batch_work(const ModelConfig& mc, int64_t tokens) {
  const double T = d(tokens), D = d(mc.dim), S = d(mc.seq_len), L = d(mc.n_layers);
  const double kv = d(mc.n_kv_heads * mc.head_dim());
  const double Lm = d(moe_layers(mc)), Ld = L - Lm;
  const double K = d(mc.moe.top_k), F = d(mc.moe.expert_hidden);
  StepWork w;
  // Forward x 3 = forward + backward (two GEMMs per forward GEMM). Attention scores and
  // values: TorchTitan's 12 x layers x dim x seq per token for forward + backward.
  w.attention_flops = 3.0 * L * 2.0 * T * D * (2.0 * D + 2.0 * kv) + 12.0 * L * D * S * T;
  w.expert_flops = 3.0 * Lm * 2.0 * T * (K + d(mc.moe.n_shared_experts)) * 3.0 * D * F +
                   3.0 * Lm * 2.0 * T * D * d(mc.moe.n_experts);  // the router's GEMM
  w.dense_flops = 3.0 * Ld * 2.0 * T * 3.0 * D * d(mc.dense_hidden);
  w.lm_head_flops = 3.0 * 2.0 * T * D * d(mc.vocab_size);
  w.memory_elements = T * D * (L + Lm * K);
  return w;
}

ParameterSplit split_parameters(const ModelConfig& mc) {
  const int64_t D = mc.dim, V = mc.vocab_size, kv = mc.n_kv_heads * mc.head_dim();
  const int64_t Lm = moe_layers(mc), Ld = mc.n_layers - Lm;
  ParameterSplit p;
  p.dense = V * D * (mc.tie_embeddings ? 1 : 2) + D;                      // embedding, head, final norm
  p.dense += mc.n_layers * (2 * D + 2 * D * D + 2 * kv * D);             // norms, wq wo, wk wv
  p.dense += Ld * 3 * D * mc.dense_hidden;
  p.dense += Lm * (mc.moe.n_experts * D + (mc.moe.router_bias ? mc.moe.n_experts : 0) +
                   mc.moe.n_shared_experts * 3 * D * mc.moe.expert_hidden);
  p.expert = Lm * mc.moe.n_experts * 3 * D * mc.moe.expert_hidden;
  return p;
}

double optimizer_bytes_per_parameter(double moment_bytes) {
  // master hi + lo (4 B) read and written, fp32 gradient read, m and v read and written, bf16 weight written
  return 4.0 * 2 + 4.0 + 4.0 * moment_bytes + 2.0;
}

ComputeRates rates_from_hardware(const HardwareDescription& hw) {
  ComputeRates r;
  const double gemm = 1e3 / (hw.peak_tflops * 1e12 * hw.matmul_efficiency);
  r.attention_ms_per_flop = r.expert_ms_per_flop = r.dense_ms_per_flop = r.lm_head_ms_per_flop = gemm;
  const double byte_ms = 1e3 / (hw.hbm_tb_s * 1e12 * hw.memory_efficiency);
  r.memory_ms_per_element = kMemoryBytesPerElement * byte_ms;
  r.optimizer_ms_per_byte = byte_ms;
  return r;
}

ComputeRates rates_from_profile(const ComputeProfile& profile, const HardwareDescription& hw) {
  const ModelConfig& mc = profile.config.model;
  const int64_t tokens = profile.config.training.micro_batch * mc.seq_len;
  const StepWork w = micro_batch_work(mc, tokens);
  const double gemm = profile.peak_tflops / hw.peak_tflops, memory = profile.hbm_tb_s / hw.hbm_tb_s;
  ComputeRates r;
  r.expert_ms_per_flop = gemm * per_unit(phase(profile, "experts") + phase(profile, "router"), w.expert_flops,
                                         1e3 / (profile.peak_tflops * 1e12 * hw.matmul_efficiency));
  r.attention_ms_per_flop = gemm * per_unit(phase(profile, "attention"), w.attention_flops, r.expert_ms_per_flop / gemm);
  r.dense_ms_per_flop = gemm * per_unit(phase(profile, "dense FFN"), w.dense_flops, r.expert_ms_per_flop / gemm);
  r.lm_head_ms_per_flop = gemm * per_unit(phase(profile, "LM head+loss"), w.lm_head_flops, r.expert_ms_per_flop / gemm);
  const double memory_ms = phase(profile, "dispatch") + phase(profile, "combine") + phase(profile, "norms+residual") +
                           phase(profile, "embedding") + phase(profile, "host gaps");
  r.memory_ms_per_element = memory * per_unit(memory_ms, w.memory_elements, 0);
  const double moment_bytes = moment_bytes_per_element(profile.config.optimizer.state_dtype);
  const ParameterSplit p = split_parameters(mc);
  r.optimizer_ms_per_byte =
      memory * per_unit(phase(profile, "optimizer"), d(p.dense + p.expert) * optimizer_bytes_per_parameter(moment_bytes),
                        1e3 / (profile.hbm_tb_s * 1e12 * hw.memory_efficiency));
  return r;
}

double probability_hit(int64_t pool, int64_t held, int64_t k) {
  MOE_CHECK(pool >= 1 && held >= 0 && held <= pool && k >= 0 && k <= pool, "probability_hit({}, {}, {})", pool, held, k);
  // C(pool - held, k) / C(pool, k) = prod_{i<k} (pool - held - i) / (pool - i)
  double miss = 1.0;
  for (int64_t i = 0; i < k; ++i) miss *= std::max(0.0, d(pool - held - i)) / d(pool - i);
  return 1.0 - miss;
}

ExchangeRows exchange_rows(int64_t n_experts, int64_t top_k, int64_t ep, int64_t ep_ranks_per_node,
                           int64_t route_groups, int64_t route_top_groups) {
  ExchangeRows rows;
  if (ep <= 1 || n_experts <= 0) return rows;
  const int64_t per_rank = n_experts / ep, nodes = ep / ep_ranks_per_node, K = std::max<int64_t>(top_k, 1);
  // Node-first groups: a token's experts lie in route_top_groups of route_groups groups,
  // any group equally likely; inside them, uniformly.
  const bool grouped = route_groups > 1;
  const int64_t G = grouped ? route_groups : 1, M = grouped ? route_top_groups : 1;
  const double group_chosen = d(M) / d(G);
  const int64_t pool = n_experts / G * M;
  // A rank holds experts of one group only when its block lies inside one (ep a multiple
  // of G); otherwise (more groups than ranks) treat it as holding `per_rank` of the pool.
  const double rank_hit = group_chosen * probability_hit(pool, std::min(per_rank, pool), K);
  rows.same_node = d(ep_ranks_per_node - 1) * rank_hit;
  rows.other_nodes = d(ep - ep_ranks_per_node) * rank_hit;
  // Distinct other nodes: a node's experts are one block of n_experts / nodes.
  const int64_t per_node = n_experts / nodes;
  if (grouped && G % nodes == 0) {
    // Each node holds G / nodes whole groups: it is reached when one of its groups is
    // chosen (M of G, without replacement) and then one of its experts in them.
    // Bounded by M nodes; with groups = nodes exactly a chosen group's node is always hit.
    const double node_groups = d(G / nodes);
    const double p_group = probability_hit(G, static_cast<int64_t>(node_groups), M);
    rows.node_distinct = d(nodes - 1) * (G == nodes ? p_group : p_group * probability_hit(pool, std::min(per_node, pool), K));
  } else {
    rows.node_distinct = d(nodes - 1) * group_chosen * probability_hit(pool, std::min(per_node, pool), K);
  }
  return rows;
}

double rank_imbalance_of_expert_imbalance(double expert_imbalance, int64_t n_experts, int64_t top_k,
                                          int64_t expert_parallel) {
  if (n_experts < 1 || top_k < 1 || top_k > n_experts)
    MOE_CONFIG_ERROR("expert imbalance: top-{} of {} experts", top_k, n_experts);
  if (expert_parallel < 1 || n_experts % expert_parallel != 0)
    MOE_CONFIG_ERROR("expert imbalance: parallel.expert_parallel {} must divide moe.n_experts ({})", expert_parallel,
                     n_experts);
  const double bound = d(n_experts) / d(top_k) - 1.0;
  if (!(expert_imbalance >= 0 && expert_imbalance <= bound * (1 + 1e-12)))
    MOE_CONFIG_ERROR("--expert-load-imbalance {}: between 0 and {} (top-{} of {} experts: one expert gets every token "
                     "at most)",
                     expert_imbalance, bound, top_k, n_experts);
  if (expert_parallel == 1 || n_experts == 1) return 0.0;
  const double hot = (1.0 + expert_imbalance) / d(n_experts);  // the busiest expert's share of the assignments
  const double others = (1.0 - hot) / d(n_experts - 1);       // each other expert's
  const double busiest_rank = hot + d(n_experts / expert_parallel - 1) * others;
  return busiest_rank * d(expert_parallel) - 1.0;
}

double rank_imbalance_of_expert_loads(const std::vector<std::vector<int64_t>>& tokens_RE, int64_t expert_parallel) {
  double sum = 0;
  int64_t rows = 0;
  for (const std::vector<int64_t>& row : tokens_RE) {
    const int64_t E = static_cast<int64_t>(row.size());
    if (expert_parallel < 1 || E % expert_parallel != 0)
      MOE_CONFIG_ERROR("expert loads: parallel.expert_parallel {} must divide the {} experts logged", expert_parallel,
                       E);
    const int64_t per_rank = E / expert_parallel;
    int64_t total = 0, busiest = 0;
    for (int64_t r = 0; r < expert_parallel; ++r) {
      int64_t rank_rows = 0;
      for (int64_t e = r * per_rank; e < (r + 1) * per_rank; ++e) rank_rows += row[static_cast<size_t>(e)];
      total += rank_rows;
      busiest = std::max(busiest, rank_rows);
    }
    if (total == 0) continue;
    sum += d(busiest) * d(expert_parallel) / d(total);
    ++rows;
  }
  if (rows == 0) MOE_CONFIG_ERROR("expert loads: no layer with assignments");
  return sum / d(rows) - 1.0;
}

double alpha_beta_ms(double bytes, double messages, double latency_us, double bytes_per_s) {
  return messages * latency_us * 1e-3 + (bytes > 0 ? bytes / bytes_per_s * 1e3 : 0.0);
}

ExchangeTime exchange_time(AllToAllKind kind, const ExchangeRows& rows, double tokens, double bytes_per_row,
                           int64_t ep, int64_t ep_ranks_per_node, const HardwareDescription& hw,
                           const MeasuredCollectives& measured) {
  ExchangeTime t;
  if (ep <= 1) return t;
  const int64_t g = ep_ranks_per_node, nodes = ep / g;
  const double intra_rate = measured.intra_all_to_all_bytes_per_s > 0 ? measured.intra_all_to_all_bytes_per_s
                                                                       : hw.intra_bytes_per_s();
  const double nic_rate = hw.nic_bytes_per_s_per_gpu(hw.gpus_per_node);
  const double other_node_bytes = rows.other_nodes * tokens * bytes_per_row;
  if (kind == AllToAllKind::Flat || nodes == 1) {
    t.intra_bytes = rows.same_node * tokens * bytes_per_row;
    t.inter_bytes = other_node_bytes;
    t.intra_messages = g - 1;
    t.inter_messages = ep - g;
    t.ms = std::max(alpha_beta_ms(t.intra_bytes, d(t.intra_messages), hw.intra_latency_us, intra_rate),
                    alpha_beta_ms(t.inter_bytes, d(t.inter_messages), hw.inter_latency_us, nic_rate));
    return t;
  }
  // Stage 1: every row bound for a rank of another local index (on any node) moves inside
  // the node: a (g-1)/g share of all rows leaving the rank, plus none of those to the
  // same local index elsewhere (ep - nodes such ranks out of ep - 1).
  const double rows_out = rows.same_node + rows.other_nodes;
  const double rank_hit = rows_out / d(ep - 1);
  t.intra_bytes = rank_hit * d(ep - nodes) * tokens * bytes_per_row;
  t.inter_bytes = other_node_bytes;
  t.intra_messages = g - 1;
  t.inter_messages = nodes - 1;
  t.ms = alpha_beta_ms(t.intra_bytes, d(t.intra_messages), hw.intra_latency_us, intra_rate) +
         alpha_beta_ms(t.inter_bytes, d(t.inter_messages), hw.inter_latency_us, nic_rate);
  return t;
}

double collective_ms(Collective kind, double bytes, int64_t n, int64_t m, double calls, const HardwareDescription& hw,
                     int64_t gpus_per_node, const MeasuredCollectives& measured) {
  if (n <= 1 || bytes <= 0) return 0.0;
  const int64_t nodes = n / m;
  if (nodes <= 1 && measured.intra_all_reduce_bus_bytes_per_s > 0) {
    const double share = d(n - 1) / d(n) * (kind == Collective::AllReduce ? 2.0 : 1.0);
    const double latency_ms = measured.intra_all_reduce_latency_us * 1e-3 * (kind == Collective::AllReduce ? 1.0 : 0.5);
    return share * bytes / measured.intra_all_reduce_bus_bytes_per_s * 1e3 + calls * latency_ms;
  }
  const double rate = nodes > 1 ? std::min(hw.intra_bytes_per_s(), hw.nic_bytes_per_s_per_gpu(gpus_per_node))
                                 : hw.intra_bytes_per_s();
  const double share = d(n - 1) / d(n) * (kind == Collective::AllReduce ? 2.0 : 1.0);
  const double hops = (kind == Collective::AllReduce ? 2.0 : 1.0);
  const double latency_ms = hops * (std::ceil(std::log2(d(nodes))) * hw.inter_latency_us + d(m - 1) * hw.intra_latency_us) * 1e-3;
  return share * bytes / rate * 1e3 + calls * latency_ms;
}

double exposed_ms(double comm_ms, double window_ms, double last_piece_ms) {
  if (comm_ms <= 0) return 0.0;
  return std::max(comm_ms - window_ms, std::min(last_piece_ms, comm_ms));
}

StepPrediction simulate_step(const RunConfig& config, const SimLayout& layout, const HardwareDescription& hw,
                             const ComputeRates& rates, const MeasuredCollectives& measured) {
  const ModelConfig& mc = config.model;
  const int64_t N = layout.gpus, G = layout.gpus_per_node, ep = std::max<int64_t>(layout.expert_parallel, 1);
  if (N < 1) MOE_CONFIG_ERROR("--gpus {}: at least 1", N);
  if (G < 1 || G > hw.gpus_per_node)
    MOE_CONFIG_ERROR("--gpus-per-node {}: between 1 and the hardware's gpus_per_node ({})", G, hw.gpus_per_node);
  if (N > G && N % G != 0) MOE_CONFIG_ERROR("--gpus {} is not a multiple of --gpus-per-node {}", N, G);
  if (N % ep != 0 || (mc.moe.n_experts > 0 && mc.moe.n_experts % ep != 0))
    MOE_CONFIG_ERROR("parallel.expert_parallel {} must divide the GPUs ({}) and moe.n_experts ({})", ep, N,
                     mc.moe.n_experts);
  const int64_t per_node = std::min(G, N);
  if (per_node % ep != 0 && ep % per_node != 0)
    MOE_CONFIG_ERROR("parallel.expert_parallel {} straddles nodes of {} GPUs unevenly", ep, per_node);
  if (layout.zero < 0 || layout.zero > 3) MOE_CONFIG_ERROR("parallel.zero {}: 0 to 3", layout.zero);
  if (layout.micro_batches < 1) MOE_CONFIG_ERROR("--micro-batches {}: at least 1", layout.micro_batches);
  if (!(layout.expert_imbalance >= 0)) MOE_CONFIG_ERROR("--expert-imbalance {}: not negative", layout.expert_imbalance);

  StepPrediction p;
  p.layout = layout;
  const double A = d(layout.micro_batches);
  const int64_t tokens = config.training.micro_batch * mc.seq_len;
  const StepWork w = micro_batch_work(mc, tokens);
  p.attention = A * w.attention_flops * rates.attention_ms_per_flop;
  p.experts = A * w.expert_flops * rates.expert_ms_per_flop * (1.0 + (ep > 1 ? layout.expert_imbalance : 0.0));
  p.dense = A * w.dense_flops * rates.dense_ms_per_flop;
  p.lm_head = A * w.lm_head_flops * rates.lm_head_ms_per_flop;
  p.memory = A * w.memory_elements * rates.memory_ms_per_element;
  // Recomputed layers run their forward again in the backward: a third more of their work.
  const int64_t recomputed = config.training.recompute_layers < 0 ? mc.n_layers
                                                                  : std::min(config.training.recompute_layers, mc.n_layers);
  const double again = 1.0 + d(recomputed) / d(mc.n_layers) / 3.0;
  p.attention *= again;
  p.experts *= again;
  p.dense *= again;
  p.memory *= again;
  p.compute = p.attention + p.experts + p.dense + p.lm_head + p.memory;

  // Parameters this rank holds and steps; the groups that reduce them.
  const ParameterSplit params = split_parameters(mc);
  const double expert_held = d(params.expert) / d(ep);
  const int64_t dp = N, edp = N / ep;
  const double moment_bytes = moment_bytes_per_element(config.optimizer.state_dtype);
  const double stepped = layout.zero >= 1 ? d(params.dense) / d(dp) + expert_held / d(edp) : d(params.dense) + expert_held;
  p.optimizer = stepped * optimizer_bytes_per_parameter(moment_bytes) * rates.optimizer_ms_per_byte;

  // The exchanges: dispatch and combine forward, their mirrors backward, per MoE layer.
  p.ep_ranks_per_node = std::min(ep, per_node);
  p.ep_nodes = ep / p.ep_ranks_per_node;
  p.rows = exchange_rows(mc.moe.n_experts, mc.moe.top_k, ep, p.ep_ranks_per_node, mc.moe.route_groups,
                         mc.moe.route_top_groups);
  p.exchange = exchange_time(layout.all_to_all, p.rows, d(tokens), d(mc.dim) * 2.0, ep, p.ep_ranks_per_node, hw, measured);
  // A recomputed MoE layer exchanges its rows again (dispatch and combine of the forward).
  const double recomputed_moe = d(std::max<int64_t>(0, recomputed - std::min(mc.first_dense_layers, recomputed)));
  p.exchanges = A * (4.0 * d(moe_layers(mc)) + 2.0 * recomputed_moe);
  p.a2a_row_bytes = p.exchanges * (p.rows.same_node + p.rows.other_nodes) * d(tokens) * d(mc.dim) * 2.0;
  p.a2a = p.exchanges * p.exchange.ms * (1.0 + (ep > 1 ? layout.expert_imbalance : 0.0));

  // Gradients: dense over all ranks, experts over their replicas (ranks r % ep equal:
  // ep >= per_node puts one per node, else per_node / ep per node).
  const double grad_bytes_per = config.parallel.grad_reduce_dtype == ReduceDtype::Bf16 ? 2.0 : 4.0;
  const int64_t edp_per_node = ep >= per_node ? 1 : per_node / ep;
  const Collective reduce = layout.zero == 0 ? Collective::AllReduce : Collective::ReduceScatter;
  const double bucket = config.parallel.bucket_mb > 0 ? config.parallel.bucket_mb * 1e6 : 1e30;
  const double dense_bytes = d(params.dense) * grad_bytes_per, expert_bytes = expert_held * grad_bytes_per;
  p.grad_bytes = (dp > 1 ? dense_bytes : 0) + (edp > 1 ? expert_bytes : 0);
  p.grad_sync = collective_ms(reduce, dense_bytes, dp, per_node, std::ceil(dense_bytes / bucket), hw, G, measured) +
                collective_ms(reduce, expert_bytes, edp, edp_per_node, std::ceil(expert_bytes / bucket), hw, G, measured);
  const double last_bucket = p.grad_sync > 0 ? p.grad_sync * std::min(1.0, bucket / std::max(p.grad_bytes, 1.0)) : 0;
  const double last_backward = (p.compute / A) * 2.0 / 3.0;  // backward = 2/3 of forward + backward
  p.grad_sync_exposed = exposed_ms(p.grad_sync, last_backward, last_bucket);

  // ZeRO weights: 1-2 all-gather the bf16 weights each rank stepped (after the optimizer);
  // 3 gathers each layer's bf16 weights for the forward and again for the backward.
  const double dense_w = d(params.dense) * 2.0, expert_w = expert_held * 2.0;
  const double gather = collective_ms(Collective::AllGather, dense_w, dp, per_node, d(mc.n_layers) + 2, hw, G, measured) +
                        collective_ms(Collective::AllGather, expert_w, edp, edp_per_node, d(moe_layers(mc)), hw, G, measured);
  if (layout.zero == 1 || layout.zero == 2) {
    p.weight_gather = gather;
    p.weight_gather_exposed = gather;
  } else if (layout.zero == 3) {
    p.weight_gather = 2.0 * A * gather;
    p.weight_gather_exposed = exposed_ms(p.weight_gather, p.compute, p.weight_gather / (2.0 * d(mc.n_layers)));
  }

  p.overlap_cost = hw.overlap_slowdown * (overlapped_ms(p.grad_sync, p.grad_sync_exposed) +
                                          overlapped_ms(p.weight_gather, p.weight_gather_exposed));
  const double comm = p.a2a + p.grad_sync_exposed + p.weight_gather_exposed + p.overlap_cost;
  p.step = p.compute + p.optimizer + comm;
  p.comm_share = comm / p.step;
  // Weak scaling: the same per-GPU work with every exchange and reduction free and the
  // experts' rows even (what the GPU would do alone with this rank's optimizer share).
  const double balanced = p.compute - (p.experts - again * A * w.expert_flops * rates.expert_ms_per_flop);
  p.efficiency = (balanced + p.optimizer) / p.step;
  p.tokens_per_s_per_gpu = A * d(tokens) / (p.step / 1e3);
  return p;
}

}  // namespace moe
