//! The MLP blocks: the sparse MoE block (router, shared expert and its gate, the routed
//! experts' call on the backend) and the dense SwiGLU MLP.

use super::load::Loader;
use super::projections::Projections;
use super::routes::StepSource;
use crate::backend::{distinct_ids, Backend, InFlight, ResidualAdd, Routing, Shared, SharedExpert};
use crate::checkpoint::{LinearWeight, RecordLayout};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::records::{ExpertRecord, ExpertSource, HeldRecord};

/// Passes of at least this many tokens get their experts through
/// [`ExpertSource::fetch_prefill`] (read outside the pool) rather than the pool, unless
/// the pool holds every record (then every pass routes on the backend, see
/// [`Moe::forward`], and counts its lookups as hits).
pub const SWEEP_MIN_TOKENS: usize = 32;

/// What a forward step keeps for the device: the records its kernels read, in guards
/// that release them only once the backend has waited for that work ([`InFlight`]), and
/// the routings whose ids are read back with the logits.
pub(super) struct StepHold<'a, B: Backend> {
    /// The previous MoE layer's records (see [`Moe::forward`]): released by the next
    /// layer's routing read-back, which waits for the work that reads them.
    pub(super) layer: InFlight<'a, B>,
    /// Whole layers of records routed on the device ([`ExpertSource::resident_layer`]):
    /// nothing waits for the device until the step ends, so they stay held until then.
    pub(super) step: InFlight<'a, B>,
    /// Routings that stayed on the device, by MoE layer: their ids are read back with the
    /// logits and counted as lookups then.
    pub(super) routings: Vec<(usize, B::Tensor)>,
}

impl<'a, B: Backend> StepHold<'a, B> {
    /// An empty hold for a step on `backend`.
    pub(super) fn new(backend: &'a B) -> Self {
        StepHold {
            layer: InFlight::new(backend),
            step: InFlight::new(backend),
            routings: Vec::new(),
        }
    }

    /// The step's final read-back: `out` and then every kept routing, in that order (one
    /// wait for all recorded work); every record is released after it. Errors: a failed
    /// read-back (the records are released once the device has been waited for).
    pub(super) fn read_back(self, out: &B::Tensor) -> Result<(Vec<Vec<f32>>, Vec<usize>)> {
        let StepHold {
            layer,
            mut step,
            routings,
        } = self;
        step.absorb(layer);
        let mut read: Vec<&B::Tensor> = vec![out];
        read.extend(routings.iter().map(|(_, r)| r));
        let values = step.read_back(&read)?;
        Ok((values, routings.into_iter().map(|(l, _)| l).collect()))
    }
}

/// A MoE layer's routings of the chunks of a pass and their records
/// ([`Moe::route_on_host`]).
pub(super) struct Routed<B: Backend, R> {
    /// Per chunk.
    routings: Vec<Routing>,
    /// The shared expert's gate `[T, 1]`, per chunk.
    shared_gates: Vec<B::Tensor>,
    /// The union of the chunks' expert ids, ascending.
    distinct: Vec<u32>,
    /// The records of `distinct`, in the same order, held in the step's `hold.layer`.
    held: std::sync::Arc<Vec<R>>,
}

/// A SwiGLU MLP (the shared expert, or a dense layer's MLP).
pub(super) struct DenseMlp<B: Backend> {
    gate_up: GateUp<B>,
    down: B::Weight,
}

/// A SwiGLU MLP's gate and up projections.
enum GateUp<B: Backend> {
    /// Stacked at load, `[2 I, hidden]`, for [`Backend::matmul_swiglu`]'s one pass.
    Stacked(B::Weight),
    /// Quantized differently (a mixed-precision conversion): two matmuls, kept as stored
    /// rather than widened to f32 to be stacked.
    Separate { gate: B::Weight, up: B::Weight },
}

/// A sparse MoE block with its shared expert (mlx-lm `Qwen3NextSparseMoeBlock`).
pub(super) struct Moe<B: Backend> {
    /// The router (`mlp.gate`, `[E, hidden]`) and the shared expert's gate
    /// (`[1, hidden]`).
    pub(super) gates: Projections<B, 2>,
    shared: DenseMlp<B>,
}

/// A layer's MLP block.
pub(super) enum Mlp<B: Backend> {
    Moe(Moe<B>),
    Dense(DenseMlp<B>),
}

impl<B: Backend> Mlp<B> {
    /// Loads the MLP block of the layer under `p` (`model.layers.{i}`): MoE if `moe`,
    /// else dense.
    pub(super) fn load(l: &Loader<'_, B>, p: &str, moe: bool) -> Result<Self> {
        let cfg = l.cfg;
        Ok(if moe {
            let (router, gate) = (
                format!("{p}.mlp.gate"),
                format!("{p}.mlp.shared_expert_gate"),
            );
            let d = cfg.hidden_size;
            Mlp::Moe(Moe {
                gates: Projections::new(
                    [
                        (router.clone(), l.ckpt.linear(&router, cfg.num_experts, d)?),
                        (gate.clone(), l.ckpt.linear(&gate, 1, d)?),
                    ],
                    |n, w| l.upload(n, w),
                )?,
                shared: DenseMlp::load(
                    l,
                    &format!("{p}.mlp.shared_expert"),
                    cfg.shared_expert_intermediate_size,
                )?,
            })
        } else {
            Mlp::Dense(DenseMlp::load(
                l,
                &format!("{p}.mlp"),
                cfg.intermediate_size,
            )?)
        })
    }
}

impl<B: Backend> DenseMlp<B> {
    /// Loads the MLP under `prefix`, of intermediate size `width`.
    fn load(l: &Loader<'_, B>, prefix: &str, width: usize) -> Result<Self> {
        let d = l.cfg.hidden_size;
        let gate = l.ckpt.linear(&format!("{prefix}.gate_proj"), width, d)?;
        let up = l.ckpt.linear(&format!("{prefix}.up_proj"), width, d)?;
        let gate_up = if LinearWeight::stack_losslessly(&[&gate, &up]) {
            let stacked = LinearWeight::stack_rows(&format!("{prefix}.up_proj"), vec![gate, up])?;
            GateUp::Stacked(l.upload(&format!("{prefix}.gate_proj"), stacked)?)
        } else {
            GateUp::Separate {
                gate: l.upload(&format!("{prefix}.gate_proj"), gate)?,
                up: l.upload(&format!("{prefix}.up_proj"), up)?,
            }
        };
        Ok(DenseMlp {
            gate_up,
            down: l.linear(&format!("{prefix}.down_proj"), d, width)?,
        })
    }

    /// The MLP on its input `x`.
    pub(super) fn forward(&self, backend: &B, x: &B::Tensor) -> B::Tensor {
        let h = match &self.gate_up {
            GateUp::Stacked(gate_up) => backend.matmul_swiglu(x, gate_up),
            GateUp::Separate { gate, up } => {
                backend.swiglu(&backend.matmul(x, gate), &backend.matmul(x, up))
            }
        };
        backend.matmul(&h, &self.down)
    }
}

impl<B: Backend> Moe<B> {
    /// The MoE block of `layer`, routed by the step's route source `routes` (the router,
    /// or a synthetic model whose ids replace the router's). `hold.layer` holds the
    /// previous MoE layer's records: a backend may still be reading them (GPU work runs
    /// after it is recorded), so they stay pinned until this layer's routing read-back,
    /// through that guard, has waited for that work; this layer's records go in after it.
    ///
    /// Returns the block's output, or with `then` the residual sum and the next block's
    /// input as [`Backend::moe_experts_resident`] returns them (the backend may fold them
    /// into the experts' last pass; otherwise they are computed after it).
    ///
    /// When the source holds every record of the layer (a pool of every record), the input
    /// is routed on the backend instead, a prompt's chunk as well as a decode step: the
    /// router's top-k stays on the device and the backend picks the records from the whole
    /// layer (a GPU groups a chunk's routes by record itself), so nothing is read back
    /// until the step ends; the layer's records stay held until then.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward<'e, E: ExpertSource>(
        &self,
        backend: &B,
        cfg: &ModelConfig,
        layout: &RecordLayout,
        layer: usize,
        x: &B::Tensor,
        routes: &mut StepSource,
        experts: &'e E,
        hold: &mut StepHold<'e, B>,
        then: Option<ResidualAdd<'_, B::Tensor>>,
    ) -> Result<(B::Tensor, Option<B::Tensor>)> {
        if let Some(resident) = experts.resident_layer(layer) {
            let [logits, shared_gate] = self.gates.apply(backend, x);
            let (k, norm) = (cfg.num_experts_per_tok, cfg.norm_topk_prob);
            let resident = hold.step.keep(resident);
            let routed = routes.on_device(backend, layer, &logits, k, norm)?;
            // Nothing waits here (the routing stays on the device), so the shared expert can
            // come first where the backend does not compute it with the routed experts.
            let computed;
            let shared = match &self.shared.gate_up {
                GateUp::Stacked(gate_up) => Shared::Mlp {
                    gate_up,
                    down: &self.shared.down,
                    gate: &shared_gate,
                },
                GateUp::Separate { .. } => {
                    computed = self.shared.forward(backend, x);
                    Shared::Output(SharedExpert {
                        y: &computed,
                        gate: &shared_gate,
                    })
                }
            };
            let out = backend.moe_experts_resident(
                x,
                &routed.routing,
                k,
                routed.ids.as_deref(),
                &resident.records(),
                layout,
                Some(shared),
                then,
            )?;
            routed.count(layer, experts, &mut hold.routings);
            return Ok(out);
        }
        let routed = self.route_on_host(backend, cfg, layer, &[x], routes, experts, hold)?;
        Ok(self.experts_on_host(backend, layout, x, &routed, 0, then))
    }

    /// The MoE block of `layer` up to its experts, on the inputs `xs` (`[T, hidden]` each)
    /// of the chunks of a pass, routed on the host: every chunk's routing is read back (the
    /// first read-back releases `hold.layer`'s records, as in [`Moe::forward`]), and the
    /// records of their union are fetched once (through [`ExpertSource::fetch_prefill`]
    /// when the chunks hold [`SWEEP_MIN_TOKENS`] tokens or more) into `hold.layer`;
    /// [`Moe::experts_on_host`] then computes each chunk. One chunk is [`Moe::forward`]'s
    /// path when the layer is not resident; several are a layer-major prefill's
    /// (`Model::forward`), whose chunks thereby read each routed record once. Errors: the
    /// read-back's, the route source's, or `experts`'.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn route_on_host<'e, E: ExpertSource>(
        &self,
        backend: &B,
        cfg: &ModelConfig,
        layer: usize,
        xs: &[&B::Tensor],
        routes: &mut StepSource,
        experts: &'e E,
        hold: &mut StepHold<'e, B>,
    ) -> Result<Routed<B, E::Record<'e>>> {
        let (k, norm) = (cfg.num_experts_per_tok, cfg.norm_topk_prob);
        let (logits, shared_gates): (Vec<B::Tensor>, Vec<B::Tensor>) = xs
            .iter()
            .map(|x| {
                let [logits, shared_gate] = self.gates.apply(backend, x);
                (logits, shared_gate)
            })
            .unzip();
        let logits: Vec<&B::Tensor> = logits.iter().collect();
        // The read-back waits for the previous layer's work: its records are released.
        let routings = routes.on_host(layer, &mut hold.layer, &logits, k, norm)?;
        let distinct = distinct_ids(routings.iter().flat_map(|r| r.ids.clone()).collect());
        let tokens: usize = routings.iter().map(Routing::tokens).sum();
        let held = if tokens >= SWEEP_MIN_TOKENS {
            let mut uses = vec![0u32; distinct.len()];
            for id in routings.iter().flat_map(|r| &r.ids) {
                if let Ok(at) = distinct.binary_search(id) {
                    uses[at] += 1;
                }
            }
            experts.fetch_prefill(layer, &distinct, &uses)?
        } else {
            experts.fetch(layer, &distinct)?
        };
        Ok(Routed {
            routings,
            shared_gates,
            distinct,
            held: hold.layer.keep(held),
        })
    }

    /// The routed experts and the shared expert of chunk `chunk` of `routed`
    /// ([`Moe::route_on_host`]), on its input `x`; returns as [`Moe::forward`] does.
    pub(super) fn experts_on_host<R: HeldRecord>(
        &self,
        backend: &B,
        layout: &RecordLayout,
        x: &B::Tensor,
        routed: &Routed<B, R>,
        chunk: usize,
        then: Option<ResidualAdd<'_, B::Tensor>>,
    ) -> (B::Tensor, Option<B::Tensor>) {
        let routing = &routed.routings[chunk];
        let records: Vec<ExpertRecord<'_>> = routing
            .ids
            .iter()
            .map(|id| {
                let r = &routed.held[routed.distinct.binary_search(id).unwrap_or_default()];
                ExpertRecord {
                    bytes: r,
                    slot: r.slot(),
                }
            })
            .collect();
        // After the routing read-back, so that the shared expert's work is not waited for.
        let shared = self.shared.forward(backend, x);
        let shared = SharedExpert {
            y: &shared,
            gate: &routed.shared_gates[chunk],
        };
        let out = backend.moe_experts(x, routing, &records, layout, Some(shared));
        ResidualAdd::apply_to(then, backend, out)
    }
}
