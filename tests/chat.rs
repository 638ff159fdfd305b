//! Multi-turn chat keeps the model state between turns: later turns read only the new
//! tokens, and give the same tokens as re-reading the whole conversation.

mod common;

use common::*;
use slotstream::backend::cpu::CpuBackend;
use slotstream::chat::Conversation;
use slotstream::generate::GenerateOptions;
use slotstream::tokenizer::{ChatTemplate, Tokenizer};

#[test]
fn chat_state_reuse_matches_re_reading_the_conversation() {
    let name = FIXTURES[0];
    let l = load_cpu(name);
    let dir = fixture_dir(name);
    let tok = Tokenizer::load(&dir).unwrap();
    let template = ChatTemplate::load(&dir).unwrap().unwrap();
    let options = GenerateOptions {
        max_tokens: 12,
        sampling: Default::default(),
        // No EOS: every reply runs to 12 tokens.
        eos_ids: vec![],
        cancel: None,
    };
    let turns = ["the cat sat on the mat", "and then what", "tell me more"];
    let mut kept = Conversation::new(&l.model, &CpuBackend);
    let mut reused_any = false;
    for (i, text) in turns.iter().enumerate() {
        let t = kept
            .turn(
                &l.model,
                &CpuBackend,
                &l.experts,
                &tok,
                &template,
                text,
                &options,
                |_| {},
            )
            .unwrap();
        if i > 0 {
            reused_any |= t.reused_tokens > 0;
        }
        // A fresh state reading the same conversation ids from the start.
        let mut state = l.model.new_state(&CpuBackend);
        let (fresh, _) = slotstream::generate::generate(
            &l.model,
            &CpuBackend,
            &l.experts,
            &mut state,
            &t.input_ids,
            &options,
            |_| Ok(true),
        )
        .unwrap();
        assert_eq!(
            t.output_ids, fresh,
            "turn {i}: kept state and re-read differ"
        );
        assert_eq!(t.reused_tokens + t.prompt_tokens, t.input_ids.len());
        if i > 0 {
            assert!(
                t.prompt_tokens < t.input_ids.len() / 2,
                "turn {i}: reuse must read only the new tokens"
            );
        }
    }
    assert!(reused_any, "no turn reused the kept state");
}
