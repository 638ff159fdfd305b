//! The byte-level tokenizer a synthetic checkpoint carries, built in code.

use std::path::Path;

use serde_json::json;

use crate::error::Result;

use super::checkpoint::write_json;
use super::presets::Preset;

/// The tokenizer files of a synthetic checkpoint (`tokenizer.json`,
/// `tokenizer_config.json`, `generation_config.json`), as `(file name, contents)`.
///
/// A byte-level BPE without merges: the 256 byte tokens, filler tokens up to the first
/// special id, then `<|endoftext|>`, `<|im_start|>` and `<|im_end|>` at the ids `special`
/// gives, which are config.json's (`bos_token_id`, `eos_token_id`). The fillers are
/// needed because the `tokenizers` crate numbers added tokens from the end of the model's
/// vocabulary whatever ids tokenizer.json lists (256 to 258 without them). Each filler is
/// two or more lowercase letters, never produced by encoding (there are no merges), so
/// text tokenizes byte by byte as before and a random model's fillers print as letters.
/// generation_config.json lists `<|im_end|>` and `<|endoftext|>` as EOS.
pub(super) fn tokenizer_files(
    [eot, start, end]: [usize; 3],
) -> [(&'static str, serde_json::Value); 3] {
    // GPT-2's byte-to-unicode table, as the ByteLevel pre-tokenizer expects.
    let mut bytes: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut chars = bytes.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bytes.contains(&b) {
            bytes.push(b);
            chars.push(256 + n);
            n += 1;
        }
    }
    let mut table: Vec<(u32, u32)> = bytes.into_iter().zip(chars).collect();
    table.sort();
    let mut model_vocab = serde_json::Map::new();
    for (b, c) in &table {
        let ch = char::from_u32(*c).unwrap_or('?').to_string();
        model_vocab.insert(ch, json!(*b));
    }
    for id in 256..eot {
        model_vocab.insert(filler(id - 256), json!(id));
    }
    let special = |id: usize, s: &str| json!({"id": id, "content": s, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true});
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(eot, "<|endoftext|>"), special(start, "<|im_start|>"), special(end, "<|im_end|>")],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": model_vocab, "merges": []},
    });
    [
        ("tokenizer.json", tokenizer),
        (
            "tokenizer_config.json",
            json!({
                "eos_token": "<|im_end|>", "bos_token": null, "pad_token": "<|endoftext|>",
                "chat_template": "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
            }),
        ),
        (
            "generation_config.json",
            json!({"eos_token_id": [end, eot]}),
        ),
    ]
}

/// The `i`-th filler token: the two-letter strings `aa` to `zz`, then the three-letter
/// ones, and so on.
pub(super) fn filler(mut i: usize) -> String {
    let mut len = 2;
    while i >= 26usize.pow(len) {
        i -= 26usize.pow(len);
        len += 1;
    }
    (0..len)
        .rev()
        .map(|d| char::from(b'a' + (i / 26usize.pow(d) % 26) as u8))
        .collect()
}

/// Writes the tokenizer files of `preset` ([`tokenizer_files`]) into `dir`.
pub(super) fn write_tokenizer(dir: &Path, preset: &Preset) -> Result<()> {
    for (name, value) in tokenizer_files(preset.special_tokens()) {
        write_json(dir, name, &value)?;
    }
    Ok(())
}

/// Rewrites the tokenizer files of a `preset` checkpoint in `dir` where they differ from
/// what this build writes (a checkpoint made by an older build, such as a demo model
/// left in the cache); the weights stay. Returns whether anything was rewritten.
/// Errors: a file that cannot be written.
pub fn refresh_tokenizer(dir: &Path, preset: &Preset) -> Result<bool> {
    let stale = tokenizer_files(preset.special_tokens())
        .iter()
        .any(|(name, want)| {
            std::fs::read_to_string(dir.join(name))
                .ok()
                .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
                .as_ref()
                != Some(want)
        });
    if stale {
        write_tokenizer(dir, preset)?;
    }
    Ok(stale)
}
