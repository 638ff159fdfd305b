//! The CPU forward pass against mlx-lm 0.32.2 (f32 arithmetic on the stored values) on
//! the committed fixtures (Qwen3-Next and Qwen3.5-MoE): teacher-forced logits, greedy
//! tokens, perplexity, and prefill + decode against one full-sequence forward.

use crate::common::*;
use slotstream::backend::cpu::CpuBackend;
use slotstream::model::Logits;

#[test]
fn teacher_forced_logits_match_mlx_lm() {
    for name in FIXTURES {
        let r = reference(name);
        let l = load_cpu(name);
        assert!(r.scored_ids.len() >= 32, "{name}: too few positions");
        let s = slotstream::score::score(&l.model, &CpuBackend, &l.experts, &r.scored_ids).unwrap();
        assert_eq!(s.vocab, r.vocab);
        let worst = worst_logit_error(name, &s.logits, &r);
        // `slotstream score` prints mlx-lm's perplexity to at least 4 significant digits.
        let rel = (s.perplexity - r.perplexity).abs() / r.perplexity;
        eprintln!(
            "{name}: worst relative logit error {worst:.3e}, perplexity {:.6} vs mlx-lm {:.6} (relative {rel:.1e})",
            s.perplexity, r.perplexity
        );
        assert!(
            rel < 5e-5,
            "{name}: perplexity {} vs mlx-lm {}",
            s.perplexity,
            r.perplexity
        );
    }
}

#[test]
fn greedy_continuation_matches_mlx_lm() {
    for name in FIXTURES {
        let r = reference(name);
        let l = load_cpu(name);
        assert!(r.greedy_ids.len() >= 24);
        let mut state = l.model.new_state(&CpuBackend);
        let mut logits = l
            .model
            .forward(
                &CpuBackend,
                &mut state,
                &r.prompt_ids,
                &l.experts,
                Logits::Last,
            )
            .unwrap();
        let mut out = Vec::new();
        for _ in 0..r.greedy_ids.len() {
            let next = argmax(&logits);
            out.push(next);
            logits = l
                .model
                .forward(&CpuBackend, &mut state, &[next], &l.experts, Logits::Last)
                .unwrap();
        }
        assert_eq!(
            out, r.greedy_ids,
            "{name}: greedy tokens differ from mlx-lm"
        );
        assert_eq!(state.tokens.len(), r.prompt_ids.len() + r.greedy_ids.len());
    }
}

#[test]
fn prefill_then_decode_equals_full_forward() {
    for name in FIXTURES {
        let r = reference(name);
        let l = load_cpu(name);
        let ids = &r.scored_ids;
        let mut full_state = l.model.new_state(&CpuBackend);
        let full = l
            .model
            .forward(&CpuBackend, &mut full_state, ids, &l.experts, Logits::All)
            .unwrap();
        // Uneven split: a prefill chunk, a second chunk, then one token at a time.
        let split = [ids.len() / 3, ids.len() / 2];
        let mut state = l.model.new_state(&CpuBackend);
        let mut got = l
            .model
            .forward(
                &CpuBackend,
                &mut state,
                &ids[..split[0]],
                &l.experts,
                Logits::All,
            )
            .unwrap();
        got.extend(
            l.model
                .forward(
                    &CpuBackend,
                    &mut state,
                    &ids[split[0]..split[1]],
                    &l.experts,
                    Logits::All,
                )
                .unwrap(),
        );
        for &id in &ids[split[1]..] {
            got.extend(
                l.model
                    .forward(&CpuBackend, &mut state, &[id], &l.experts, Logits::Last)
                    .unwrap(),
            );
        }
        for t in 0..ids.len() {
            let row = t * r.vocab..(t + 1) * r.vocab;
            let e = rel_err(&got[row.clone()], &full[row]);
            assert!(
                e <= 1e-5,
                "{name}: position {t}: chunked vs full relative error {e}"
            );
        }
    }
}

#[test]
fn inputs_longer_than_a_prefill_chunk_equal_token_by_token_decode() {
    use rand::Rng;
    let name = FIXTURES[1];
    let l = load_cpu(name);
    let mut rng = rand::rng();
    let n = slotstream::backend::PREFILL_CHUNK + 45;
    let ids: Vec<u32> = (0..n).map(|_| rng.random_range(0..500)).collect();
    let mut full_state = l.model.new_state(&CpuBackend);
    let full = l
        .model
        .forward(&CpuBackend, &mut full_state, &ids, &l.experts, Logits::All)
        .unwrap();
    let vocab = l.model.config.vocab_size;
    assert_eq!(full.len(), n * vocab);
    let mut state = l.model.new_state(&CpuBackend);
    let mut got = l
        .model
        .forward(&CpuBackend, &mut state, &ids[..20], &l.experts, Logits::All)
        .unwrap();
    for &id in &ids[20..] {
        got.extend(
            l.model
                .forward(&CpuBackend, &mut state, &[id], &l.experts, Logits::Last)
                .unwrap(),
        );
    }
    for t in 0..n {
        let row = t * vocab..(t + 1) * vocab;
        let e = rel_err(&got[row.clone()], &full[row]);
        assert!(
            e <= 1e-5,
            "position {t}: chunked vs token-by-token relative error {e}"
        );
    }
}
