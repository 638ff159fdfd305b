//! The MLP blocks: the sparse MoE block (router, shared expert and its gate, the routed
//! experts' call on the backend) and the dense SwiGLU MLP.

use super::load::Loader;
use super::projections::Projections;
use super::routes::StepSource;
use crate::backend::{Backend, InFlight, ResidualAdd, Shared, SharedExpert};
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
    /// Loads the MLP block of layer `i` under `p` (`model.layers.{i}`): MoE or dense as
    /// the config says.
    pub(super) fn load(l: &Loader<'_, B>, p: &str, i: usize) -> Result<Self> {
        let cfg = l.cfg;
        Ok(if cfg.is_moe_layer(i) {
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
        let [logits, shared_gate] = self.gates.apply(backend, x);
        let resident = experts.resident_layer(layer);
        let (k, norm) = (cfg.num_experts_per_tok, cfg.norm_topk_prob);
        if let Some(resident) = resident {
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
        // The read-back waits for the previous layer's work: its records are released.
        let routing = routes.on_host(layer, &mut hold.layer, &logits, k, norm)?;
        let distinct = routing.distinct();
        let held = if routing.tokens() >= SWEEP_MIN_TOKENS {
            let mut uses = vec![0u32; distinct.len()];
            for id in &routing.ids {
                if let Ok(at) = distinct.binary_search(id) {
                    uses[at] += 1;
                }
            }
            experts.fetch_prefill(layer, &distinct, &uses)?
        } else {
            experts.fetch(layer, &distinct)?
        };
        let held = hold.layer.keep(held);
        let records: Vec<ExpertRecord<'_>> = routing
            .ids
            .iter()
            .map(|id| {
                let r = &held[distinct.binary_search(id).unwrap_or_default()];
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
            gate: &shared_gate,
        };
        let out = backend.moe_experts(x, &routing, &records, layout, Some(shared));
        Ok(ResidualAdd::apply_to(then, backend, out))
    }
}
