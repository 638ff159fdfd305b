//! Route sources: where a MoE layer's expert ids come from. The forward pass and its
//! lookahead ask a step's [`StepSource`] for each layer's routing and each guess, and do
//! not know which source answers: the checkpoint's router ([`RouteSource::Router`]), or a
//! synthetic routing model ([`RouteSource::Synthetic`]) whose ids replace the router's
//! while its mixing weights stay.

use std::thread::Scope;

use crate::backend::{distinct_ids, Backend, InFlight, Routing};
use crate::error::{Error, Result};
use crate::records::ExpertSource;
use crate::routing_model::{RoutingModel, RoutingState, StepRoutes};

/// Where a model's MoE layers get their expert ids.
#[derive(Clone, Debug)]
pub enum RouteSource {
    /// The checkpoint's router: the top-k of its softmax (the default).
    Router,
    /// A synthetic routing model (a synthetic checkpoint's
    /// [`crate::routing_model::ROUTING_FILE`]) picks the ids; the router's mixing weights
    /// stay, rank by rank, and its lookahead guesses are the model's forecasts.
    Synthetic(RoutingModel),
}

impl RouteSource {
    /// The synthetic routing model, when this source is one.
    pub fn synthetic(&self) -> Option<&RoutingModel> {
        match self {
            RouteSource::Router => None,
            RouteSource::Synthetic(model) => Some(model),
        }
    }

    /// What a fresh sequence carries for this source: the synthetic model's state (none
    /// for the router, which keeps nothing between steps).
    pub(super) fn new_state(&self) -> Option<RoutingState> {
        self.synthetic().map(RoutingModel::new_state)
    }

    /// The source for one step of `tokens` at positions `start..` through the MoE
    /// `layers`, advancing `state` (the sequence's, from [`RouteSource::new_state`]): a
    /// synthetic model starts routing every layer ahead on a thread of `scope` (with the
    /// lookahead forecasts if `forecast`). Errors: a synthetic source with a state made
    /// by a model without one.
    pub(super) fn step<'scope, 'env>(
        &'env self,
        scope: &'scope Scope<'scope, 'env>,
        state: Option<&'env mut RoutingState>,
        layers: Vec<usize>,
        (start, tokens): (u64, &'env [u32]),
        forecast: bool,
    ) -> Result<StepSource> {
        Ok(match self {
            RouteSource::Router => StepSource::Router,
            RouteSource::Synthetic(model) => {
                let state = state.ok_or_else(|| {
                    Error::InvalidInput(
                        "this sequence's state has no synthetic routing state (made by another model); start a new sequence".into(),
                    )
                })?;
                StepSource::Synthetic(StepRoutes::spawn(
                    scope,
                    model,
                    state,
                    layers,
                    (start, tokens),
                    forecast,
                ))
            }
        })
    }
}

/// One step's route source ([`RouteSource::step`]).
pub(super) enum StepSource {
    Router,
    /// The synthetic model's routes, computed ahead on helper threads.
    Synthetic(StepRoutes),
}

/// A layer's routing left on the device ([`StepSource::on_device`]).
pub(super) struct DeviceRouting<B: Backend> {
    /// The router's routing ([`Backend::router_top_k_device`]): its weights, and its ids
    /// unless `ids` replace them.
    pub(super) routing: B::Tensor,
    /// Ids `[T, k]` that replace the router's, known on the host.
    pub(super) ids: Option<Vec<u32>>,
}

impl<B: Backend> DeviceRouting<B> {
    /// Counts `layer`'s lookups with `experts`: now when the ids are on the host, else
    /// once the step's final read-back brings the routing back (it goes to `pending`).
    pub(super) fn count<E: ExpertSource>(
        self,
        layer: usize,
        experts: &E,
        pending: &mut Vec<(usize, B::Tensor)>,
    ) {
        match self.ids {
            Some(ids) => experts.count_lookups(layer, &distinct_ids(ids)),
            None => pending.push((layer, self.routing)),
        }
    }
}

impl StepSource {
    /// `layer`'s routings of `logits` (one `[T, E]` per chunk of the pass) read back to
    /// the host: the router's top-k (softmax weights, renormalized if `renormalize`)
    /// through `pins`, whose first read-back releases what the previous layer's work read;
    /// a synthetic source replaces the ids, each chunk taking its rows of the pass's ids in
    /// order. Errors: the read-back's, the synthetic model's, or synthetic ids that do not
    /// match the chunks' tokens.
    pub(super) fn on_host<B: Backend>(
        &mut self,
        layer: usize,
        pins: &mut InFlight<'_, B>,
        logits: &[&B::Tensor],
        k: usize,
        renormalize: bool,
    ) -> Result<Vec<Routing>> {
        let mut routings = logits
            .iter()
            .map(|l| pins.router_top_k(l, k, renormalize))
            .collect::<Result<Vec<_>>>()?;
        if let StepSource::Synthetic(routes) = self {
            let ids = routes.ids(layer)?;
            let want: usize = routings.iter().map(|r| r.ids.len()).sum();
            if ids.len() != want {
                return Err(Error::Internal(format!(
                    "synthetic routing: {} ids for layer {layer}, {want} routes asked",
                    ids.len()
                )));
            }
            let mut rest = &ids[..];
            for routing in &mut routings {
                let (mine, after) = rest.split_at(routing.ids.len());
                routing.ids = mine.to_vec();
                rest = after;
            }
        }
        Ok(routings)
    }

    /// `layer`'s routing of `logits` left on the device (nothing read back), with the
    /// ids that replace the router's when the source has its own. Errors: the backend's,
    /// or the synthetic model's.
    pub(super) fn on_device<B: Backend>(
        &mut self,
        backend: &B,
        layer: usize,
        logits: &B::Tensor,
        k: usize,
        renormalize: bool,
    ) -> Result<DeviceRouting<B>> {
        let ids = match self {
            StepSource::Router => None,
            StepSource::Synthetic(routes) => Some(routes.ids(layer)?),
        };
        Ok(DeviceRouting {
            routing: backend.router_top_k_device(logits, k, renormalize)?,
            ids,
        })
    }

    /// The lookahead's guess of the experts `layer` will route to (distinct, ascending):
    /// `router`'s (the layer's router on the current hidden state), or the synthetic
    /// model's forecast, which knows the ids its model will pick (the random router of a
    /// synthetic checkpoint does not). Errors: `router`'s, or the synthetic model's.
    pub(super) fn guess(
        &mut self,
        layer: usize,
        router: impl FnOnce() -> Result<Vec<u32>>,
    ) -> Result<Vec<u32>> {
        match self {
            StepSource::Router => router(),
            StepSource::Synthetic(routes) => routes.forecast(layer),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing_model::RoutingParams;

    /// The router's guess comes from the router; a synthetic source answers with its
    /// model's forecast and ids without asking the router, and refuses a sequence state
    /// that has no routing state rather than falling back to the router.
    #[test]
    fn each_source_answers_for_itself() {
        let model = RoutingModel::new(RoutingParams::calibrated(), 4, 64, 4).unwrap();
        let tokens = [3u32, 1, 4];
        let router = RouteSource::Router;
        assert!(router.new_state().is_none());
        let synthetic = RouteSource::Synthetic(model.clone());
        let mut reference = model.new_state();
        let want = model
            .route_chunk(&mut reference, 2, 0, &tokens, true)
            .unwrap();
        let mut state = synthetic.new_state().unwrap();
        std::thread::scope(|scope| {
            let mut step = router
                .step(scope, None, vec![2], (0, &tokens), true)
                .unwrap();
            assert_eq!(step.guess(2, || Ok(vec![7])).unwrap(), vec![7]);
            let mut step = synthetic
                .step(scope, Some(&mut state), vec![2], (0, &tokens), true)
                .unwrap();
            let asked = || -> Result<Vec<u32>> { panic!("a synthetic source asked the router") };
            assert_eq!(step.guess(2, asked).unwrap(), want.forecast);
            let StepSource::Synthetic(routes) = &mut step else {
                panic!("a synthetic source stepped as the router");
            };
            assert_eq!(routes.ids(2).unwrap(), want.ids);
            let e = synthetic.step(scope, None, vec![2], (0, &tokens), true);
            assert!(matches!(e, Err(Error::InvalidInput(_))));
        });
        assert_eq!(state, reference);
    }
}
