//! Images: the image processor against transformers 5.24.0's `Qwen2VLImageProcessor`
//! (tests/fixtures/qwen3_5-moe-vision, made by tools/make_vision_fixtures.py),
//! decoding's refusals, the tower against transformers' `Qwen3_5MoeVisionModel`, and a
//! prompt with images against the whole transformers model on every backend.

use std::io::Cursor;

use serde_json::Value;
use slotstream::config::ModelConfig;
use slotstream::image_processor::{decode, ImageProcessor};
use slotstream::model::Logits;
use slotstream::Error;

use crate::common::{backend_tests, compare, fixture_dir, load, read_json, TestBackend};

const FIXTURE: &str = "qwen3_5-moe-vision";

/// The fixture's vision config (a small tower with the released patch sizes).
fn vision_config() -> slotstream::config::VisionConfig {
    let cfg = ModelConfig::load(&fixture_dir(FIXTURE)).unwrap();
    cfg.vision.expect("the fixture has a vision_config")
}

/// The processor with a fixture entry's settings (`size.shortest_edge`/`longest_edge`).
fn processor_from(settings: &Value) -> ImageProcessor {
    let mut p = ImageProcessor::for_tower(&vision_config());
    let n = |v: &Value| v.as_u64().unwrap() as usize;
    p.min_pixels = n(&settings["size"]["shortest_edge"]);
    p.max_pixels = n(&settings["size"]["longest_edge"]);
    assert_eq!(n(&settings["patch_size"]), p.patch_size);
    assert_eq!(n(&settings["merge_size"]), p.merge_size);
    assert_eq!(n(&settings["temporal_patch_size"]), p.temporal_patch_size);
    p
}

/// A safetensors file's f32 tensor.
fn f32_tensor(st: &safetensors::SafeTensors<'_>, name: &str) -> (Vec<usize>, Vec<f32>) {
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), safetensors::Dtype::F32, "{name}");
    let values = t
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    (t.shape().to_vec(), values)
}

#[test]
fn released_processor_defaults_are_the_fixture_generators() {
    let want = read_json(&fixture_dir(FIXTURE).join("processor_sizes.json"));
    let p = processor_from(&want["processor"]);
    let released = ImageProcessor::for_tower(&vision_config());
    assert_eq!(p, released);
    assert_eq!(released.max_pixels, 2_304 * 32 * 32);
    for c in 0..3 {
        assert_eq!(
            released.image_mean[c] as f64,
            want["processor"]["image_mean"][c]
        );
        assert_eq!(
            released.image_std[c] as f64,
            want["processor"]["image_std"][c]
        );
    }
}

/// For 319 sizes (random over four scales, and the edges: 1x1, sides that round half to
/// even, ratios at and over 200, images over the pixel bound), the grid and so the token
/// count are the processor's, and every size it refuses is refused.
#[test]
fn token_counts_equal_the_processors_for_every_size() {
    let want = read_json(&fixture_dir(FIXTURE).join("processor_sizes.json"));
    let p = processor_from(&want["processor"]);
    let cases = want["cases"].as_array().unwrap();
    assert!(cases.len() > 300);
    for case in cases {
        let (h, w) = (
            case["height"].as_u64().unwrap(),
            case["width"].as_u64().unwrap(),
        );
        let got = p.grid(h as usize, w as usize);
        match case.get("grid") {
            Some(grid) => {
                let g = got.unwrap_or_else(|e| panic!("{h}x{w}: {e}"));
                let grid: Vec<usize> = grid
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_u64().unwrap() as usize)
                    .collect();
                assert_eq!(vec![g.t, g.h, g.w], grid, "{h}x{w}");
                let tokens = g.patches() / (p.merge_size * p.merge_size);
                assert!(tokens <= 2_304 && tokens * 4 == g.patches(), "{h}x{w}");
            }
            None => assert!(
                matches!(got, Err(Error::Image(ref m)) if m.contains("aspect ratio")),
                "{h}x{w}: the processor refuses it ({}), ours gives {got:?}",
                case["error"]
            ),
        }
    }
}

/// The fixture's PNGs through our processor: the grid is the processor's, and the patches
/// equal its `pixel_values` where no resampling is needed (to f32 rounding) and lie within
/// a few levels of 255 where the image is resized (Catmull-Rom against torchvision's
/// antialiased bicubic).
#[test]
fn patches_match_the_processors_pixel_values() {
    let dir = fixture_dir(FIXTURE);
    let cases = read_json(&dir.join("vision_cases.json"));
    let bytes = std::fs::read(dir.join("vision_cases.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    for case in cases["cases"].as_array().unwrap() {
        let what = case["what"].as_str().unwrap();
        let p = processor_from(&case["processor"]);
        let png = std::fs::read(dir.join(case["image"].as_str().unwrap())).unwrap();
        let image = decode(&png, 1 << 20).unwrap();
        let (h, w) = (
            case["height"].as_u64().unwrap(),
            case["width"].as_u64().unwrap(),
        );
        assert_eq!(
            (image.height() as u64, image.width() as u64),
            (h, w),
            "{what}"
        );
        let got = p.preprocess(&image).unwrap();
        let grid: Vec<u64> = case["grid"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        assert_eq!(
            vec![got.grid.t as u64, got.grid.h as u64, got.grid.w as u64],
            grid,
            "{what}"
        );
        let (shape, want) = f32_tensor(&st, case["pixels"].as_str().unwrap());
        assert_eq!(shape, vec![got.grid.patches(), 3 * 2 * 16 * 16], "{what}");
        let resized = p.resized_size(h as usize, w as usize).unwrap() != (h as usize, w as usize);
        if resized {
            // One level is 2/255 after normalization: the two bicubic filters differ by
            // under one level on average (0.17 measured).
            let mean = got
                .values
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .sum::<f32>()
                / want.len() as f32;
            assert!(mean < 2.0 / 255.0, "{what}: mean difference {mean}");
            compare::assert_rel(what, &got.values, &want, 0.02);
        } else {
            compare::assert_rel(what, &got.values, &want, 1e-6);
        }
    }
}

/// Encodes `image` in `format` with the `image` crate's encoders.
fn encode(image: &image::DynamicImage, format: image::ImageFormat) -> Vec<u8> {
    let mut out = Cursor::new(Vec::new());
    image.write_to(&mut out, format).unwrap();
    out.into_inner()
}

/// A random RGB image.
fn random_rgb(width: u32, height: u32) -> image::RgbImage {
    let mut rng = rand::rng();
    image::RgbImage::from_fn(width, height, |_, _| {
        image::Rgb([
            rand::Rng::random(&mut rng),
            rand::Rng::random(&mut rng),
            rand::Rng::random(&mut rng),
        ])
    })
}

#[test]
fn png_webp_and_jpeg_decode_to_their_pixels() {
    let rgb = random_rgb(37, 23);
    let dynamic = image::DynamicImage::ImageRgb8(rgb.clone());
    for format in [image::ImageFormat::Png, image::ImageFormat::WebP] {
        let got = decode(&encode(&dynamic, format), 1 << 20).unwrap();
        assert_eq!(got, rgb, "{format:?} is lossless");
    }
    // JPEG is lossy: a flat colour survives it within a few levels.
    let flat = image::RgbImage::from_pixel(40, 24, image::Rgb([200, 40, 90]));
    let jpeg = encode(
        &image::DynamicImage::ImageRgb8(flat),
        image::ImageFormat::Jpeg,
    );
    let got = decode(&jpeg, 1 << 20).unwrap();
    assert_eq!(got.dimensions(), (40, 24));
    for (a, b) in got
        .pixels()
        .flat_map(|p| p.0)
        .zip([200u8, 40, 90].iter().cycle())
    {
        assert!(a.abs_diff(*b) <= 4, "JPEG pixel {a} for {b}");
    }
}

#[test]
fn a_gif_decodes_to_its_first_frame_and_transparency_to_white() {
    use image::codecs::gif::GifEncoder;
    use image::{Delay, Frame, Rgba, RgbaImage};
    let red = RgbaImage::from_pixel(8, 6, Rgba([255, 0, 0, 255]));
    let blue = RgbaImage::from_pixel(8, 6, Rgba([0, 0, 255, 255]));
    let mut gif = Vec::new();
    {
        let mut enc = GifEncoder::new(&mut gif);
        for frame in [red, blue] {
            let frame = Frame::from_parts(frame, 0, 0, Delay::from_numer_denom_ms(100, 1));
            enc.encode_frame(frame).unwrap();
        }
    }
    let got = decode(&gif, 1 << 20).unwrap();
    assert!(got.pixels().all(|p| p.0 == [255, 0, 0]), "the first frame");

    // A transparent pixel over white, a half-transparent black one grey, an opaque one as is.
    let rgba = RgbaImage::from_fn(3, 1, |x, _| match x {
        0 => Rgba([10, 20, 30, 0]),
        1 => Rgba([0, 0, 0, 128]),
        _ => Rgba([10, 20, 30, 255]),
    });
    let png = encode(
        &image::DynamicImage::ImageRgba8(rgba),
        image::ImageFormat::Png,
    );
    let got = decode(&png, 1 << 20).unwrap();
    assert_eq!(got.get_pixel(0, 0).0, [255, 255, 255]);
    assert_eq!(got.get_pixel(1, 0).0, [127, 127, 127]);
    assert_eq!(got.get_pixel(2, 0).0, [10, 20, 30]);
}

/// Not an image, a truncated one, a decompression bomb (a header that claims 10⁶ x 10⁶
/// pixels over a few bytes of data) and a real image over the pixel limit: each a clear
/// [`Error::Image`], none a panic or a large allocation.
#[test]
fn bad_images_are_refused_clearly() {
    let message = |bytes: &[u8], limit: u64| match decode(bytes, limit) {
        Err(Error::Image(m)) => m,
        other => panic!("expected an image error, got {other:?}"),
    };
    assert!(message(b"just some text, not a picture", 1 << 20).contains("not an image"));
    assert!(message(b"", 1 << 20).contains("not an image"));

    let png = encode(
        &image::DynamicImage::ImageRgb8(random_rgb(64, 48)),
        image::ImageFormat::Png,
    );
    let cut = &png[..png.len() / 2];
    assert!(message(cut, 1 << 20).contains("cannot decode"), "truncated");

    // A PNG whose IHDR claims 1,000,000 x 1,000,000 pixels (a valid CRC), then one IDAT.
    let mut bomb = b"\x89PNG\r\n\x1a\n".to_vec();
    let chunk = |kind: &[u8], data: &[u8], out: &mut Vec<u8>| {
        out.extend((data.len() as u32).to_be_bytes());
        let mut crc = crc32fast::Hasher::new();
        crc.update(kind);
        crc.update(data);
        out.extend(kind);
        out.extend(data);
        out.extend(crc.finalize().to_be_bytes());
    };
    let mut ihdr = Vec::new();
    ihdr.extend(1_000_000u32.to_be_bytes());
    ihdr.extend(1_000_000u32.to_be_bytes());
    ihdr.extend([8, 2, 0, 0, 0]); // 8-bit RGB
    chunk(b"IHDR", &ihdr, &mut bomb);
    chunk(b"IDAT", &[0x78, 0x9c, 0x03, 0x00], &mut bomb);
    chunk(b"IEND", &[], &mut bomb);
    let m = message(&bomb, 50_000_000);
    assert!(
        m.contains("1000000x1000000") && m.contains("over the limit"),
        "{m}"
    );

    // A flat 3000 x 3000 PNG: 9 megapixels (27 MB decoded) in a small file.
    let flat = image::RgbImage::from_pixel(3000, 3000, image::Rgb([1, 2, 3]));
    let png = encode(
        &image::DynamicImage::ImageRgb8(flat),
        image::ImageFormat::Png,
    );
    assert!(png.len() < 1_000_000, "{} bytes", png.len());
    let m = message(&png, 4_000_000);
    assert!(m.contains("9.0 megapixels") && m.contains("4.0"), "{m}");
    assert_eq!(decode(&png, 9_000_000).unwrap().dimensions(), (3000, 3000));
}

/// The tower's merged rows against transformers' `Qwen3_5MoeVisionModel` (f32 on the
/// stored bf16 weights, under the MLX names with the channels-last patch embedding) for
/// four images: one token, non-square, one resized to the processor's pixel bound, and a
/// resized non-square one, each from the processor's own `pixel_values`.
#[test]
fn tower_rows_match_transformers() {
    let dir = fixture_dir(FIXTURE);
    let ckpt = slotstream::checkpoint::Checkpoint::open(&dir).unwrap();
    let tower = slotstream::model::VisionTower::load(&ckpt).unwrap();
    let cases = read_json(&dir.join("vision_cases.json"));
    let bytes = std::fs::read(dir.join("vision_cases.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let out_hidden = ckpt.config.hidden_size;
    for case in cases["cases"].as_array().unwrap() {
        let what = case["what"].as_str().unwrap();
        let (_, pixels) = f32_tensor(&st, case["pixels"].as_str().unwrap());
        let g: Vec<usize> = case["grid"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as usize)
            .collect();
        let grid = slotstream::image_processor::Grid {
            t: g[0],
            h: g[1],
            w: g[2],
        };
        let patches = slotstream::image_processor::Patches {
            grid,
            values: pixels,
            tokens: grid.patches() / 4,
        };
        let got = tower.forward(&patches).unwrap();
        let (shape, want) = f32_tensor(&st, case["tower"].as_str().unwrap());
        assert_eq!(shape, vec![patches.tokens, out_hidden], "{what}");
        for (t, (g, w)) in got
            .chunks(out_hidden)
            .zip(want.chunks(out_hidden))
            .enumerate()
        {
            compare::assert_rel(&format!("{what}: token {t}"), g, w, 1e-5);
        }
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        // 1.5e-6 measured: f32 against f32, summed in other orders.
        assert!(worst < 1e-4, "{what}: largest difference {worst}");
    }
}

/// A Qwen3.5-MoE synth with the small tower: its config reads back the tower's geometry,
/// and the tower loads (channels-last patch embedding) and turns an image into one row of
/// the model's width per token. The released tower is 897,862,112 bytes in bf16 at width
/// 2560 (Flash-Next), the spec's 0.9 GB.
#[test]
fn a_synth_with_a_tower_loads_and_runs_it() {
    use slotstream::tools::synth::{Preset, SMALL_VISION_SHAPE, VISION_SHAPE};
    let preset = Preset {
        family: slotstream::config::Family::Qwen35Moe,
        vision: Some(SMALL_VISION_SHAPE),
        ..crate::common::TINY
    };
    let dir = tempfile::tempdir().unwrap();
    slotstream::tools::synth::write_checkpoint_with(dir.path(), &preset, 1, false, None).unwrap();
    let ckpt = slotstream::checkpoint::Checkpoint::open(dir.path()).unwrap();
    let v = ckpt.config.vision.clone().unwrap();
    assert_eq!(
        (v.depth, v.hidden_size, v.num_heads, v.out_hidden_size),
        (2, 64, 4, preset.hidden)
    );
    let tower = slotstream::model::VisionTower::load(&ckpt).unwrap();
    let p = ImageProcessor::for_tower(&v);
    let patches = p.preprocess(&random_rgb(300, 170)).unwrap();
    let rows = tower.forward(&patches).unwrap();
    assert_eq!(rows.len(), patches.tokens * preset.hidden);
    assert!(rows.iter().all(|x| x.is_finite()));

    let flash = slotstream::tools::synth::QWEN38_FLASH_NEXT;
    assert_eq!(flash.vision, Some(VISION_SHAPE));
    let text_only = Preset {
        vision: None,
        ..flash
    };
    assert_eq!(
        flash.checkpoint_bytes(2) - text_only.checkpoint_bytes(2),
        897_862_112
    );
}

/// The released tower's time per image on the CPU backend at 1, 256 and 2,304 tokens
/// (grids of 2 x 2, 32 x 32 and 96 x 96 patches; a synth tower, random weights), printed
/// for BENCHMARKS.md. Minutes on 2 cores, so ignored:
/// `cargo test --release --test integration vision::tower_time_per_image -- --ignored --nocapture`.
#[test]
#[ignore]
fn tower_time_per_image() {
    use slotstream::image_processor::{Grid, Patches};
    use slotstream::tools::synth::{Preset, QWEN35_35B, VISION_SHAPE};
    let preset = Preset {
        family: slotstream::config::Family::Qwen35Moe,
        hidden: QWEN35_35B.hidden,
        vision: Some(VISION_SHAPE),
        ..crate::common::TINY
    };
    let dir = tempfile::tempdir().unwrap();
    slotstream::tools::synth::write_checkpoint_with(dir.path(), &preset, 1, false, None).unwrap();
    let ckpt = slotstream::checkpoint::Checkpoint::open(dir.path()).unwrap();
    let tower = slotstream::model::VisionTower::load(&ckpt).unwrap();
    let values = tower.config().patch_values();
    let image = |side: usize| {
        let grid = Grid {
            t: 1,
            h: side,
            w: side,
        };
        let mut rng = rand::rng();
        Patches {
            grid,
            values: (0..grid.patches() * values)
                .map(|_| rand::Rng::random_range(&mut rng, -1.0..1.0))
                .collect(),
            tokens: grid.patches() / 4,
        }
    };
    // Warm-up: the weights' pages, rayon's threads.
    tower.forward(&image(2)).unwrap();
    for (side, runs) in [(2, 5), (32, 3), (96, 1)] {
        let patches = image(side);
        let grid = patches.grid;
        let start = std::time::Instant::now();
        for _ in 0..runs {
            tower.forward(&patches).unwrap();
        }
        let per = start.elapsed().as_secs_f64() / runs as f64;
        // Multiply-adds x 2 of the matmuls and the attention (QK^T and PV).
        let v = VISION_SHAPE;
        let (n, d, i) = (
            grid.patches() as f64,
            v.hidden as f64,
            v.intermediate as f64,
        );
        let blocks = v.depth as f64 * (2.0 * n * (4.0 * d * d + 2.0 * d * i) + 4.0 * n * n * d);
        let ends = 2.0 * n * values as f64 * d
            + 2.0 * (n / 4.0) * (16.0 * d * d + 4.0 * d * preset.hidden as f64);
        println!(
            "tower: {} tokens ({side} x {side} patches): {per:.3} s per image ({runs} runs), {:.1} GFLOP/s",
            patches.tokens,
            (blocks + ends) / per / 1e9
        );
    }
}

backend_tests!(logits_with_images_match_transformers);

/// The fixture's prompt with two images (a 2 x 5 grid of tokens, then one token) and text
/// after each: the images through our processor and tower, their rows over the
/// placeholders, and the M-RoPE positions; the teacher-forced logits of every position
/// within 1e-3 of transformers' `Qwen3_5MoeForConditionalGeneration` (f32, the text
/// fixture's weights dequantized, tools/make_vision_fixtures.py), the sequence's next
/// position `get_rope_index`'s, and the same logits when the prompt is cut inside the
/// first image and when its last token is decoded after the rest.
fn logits_with_images_match_transformers<B: TestBackend>(b: &B) {
    let dir = fixture_dir(FIXTURE);
    let doc = read_json(&dir.join("image_prompt.json"));
    let cases = read_json(&dir.join("vision_cases.json"));
    let (ckpt, model, experts) = load(FIXTURE, b);
    let tower = slotstream::model::VisionTower::load(&ckpt).unwrap();
    let images: Vec<_> = (doc["images"].as_array().unwrap().iter())
        .zip(doc["grids"].as_array().unwrap())
        .map(|(name, grid)| {
            let case = (cases["cases"].as_array().unwrap().iter())
                .find(|c| c["image"] == *name)
                .unwrap();
            let png = std::fs::read(dir.join(name.as_str().unwrap())).unwrap();
            let patches = processor_from(&case["processor"])
                .preprocess(&decode(&png, 1 << 20).unwrap())
                .unwrap();
            let g = patches.grid;
            assert_eq!(serde_json::json!([g.t, g.h, g.w]), *grid, "{name}");
            tower.embed(&patches).unwrap()
        })
        .collect();
    let ids: Vec<u32> = (doc["input_ids"].as_array().unwrap().iter())
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let npy =
        npyz::NpyFile::new(std::fs::File::open(dir.join("image_logits.npy")).unwrap()).unwrap();
    let vocab = npy.shape()[1] as usize;
    let want: Vec<f32> = npy.into_vec().unwrap();
    assert_eq!(want.len(), ids.len() * vocab);
    let bound = b.pick(1e-3, 1e-3);

    let mut state = model.new_state(b);
    model.place_images(&mut state, &ids, &images).unwrap();
    let got = model
        .forward(b, &mut state, &ids, &experts, Logits::All)
        .unwrap();
    let mut worst = 0.0f64;
    for (t, (g, w)) in got.chunks(vocab).zip(want.chunks(vocab)).enumerate() {
        let e = compare::assert_rel(&format!("{}: position {t}", b.name()), g, w, bound);
        worst = worst.max(e);
    }
    eprintln!("{}: worst relative logit error {worst:.2e}", b.name());
    let next = doc["next_position"].as_u64().unwrap() as usize;
    assert_eq!(state.next_position(), next);
    assert_ne!(next, ids.len(), "the images move the positions");

    // Cut inside the first image (its tokens are 6..16), then the last token decoded.
    let n = ids.len();
    let mut state = model.new_state(b);
    model.place_images(&mut state, &ids, &images).unwrap();
    for piece in [&ids[..10], &ids[10..n - 1]] {
        model
            .forward(b, &mut state, piece, &experts, Logits::Last)
            .unwrap();
    }
    let last = model
        .forward(b, &mut state, &ids[n - 1..], &experts, Logits::Last)
        .unwrap();
    compare::assert_rel("decoded last token", &last, &want[(n - 1) * vocab..], bound);
    assert_eq!(state.next_position(), next);
}

/// A chat template that renders images as Qwen3.5's does (`{"type": "image"}` parts as
/// `<|vision_start|><|image_pad|><|vision_end|>`, text parts as their text).
pub(crate) const IMAGE_TEMPLATE: &str = "{%- for message in messages %}<|im_start|>{{ message.role }}\n\
{%- if message.content is string %}{{ message.content }}{%- else %}{%- for item in message.content %}\
{%- if item.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>\
{%- elif item.type == 'text' %}{{ item.text }}{%- endif %}{%- endfor %}{%- endif %}<|im_end|>\n\
{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}";

/// A user message with `png` before its text.
fn image_chat(png: &[u8]) -> slotstream::chat_template::Chat {
    use slotstream::chat_template::{Chat, ChatImage, Message};
    Chat::new(vec![Message {
        images: vec![ChatImage {
            at: 0,
            bytes: png.into(),
        }],
        ..Message::new("user", "What is in the picture?")
    }])
}

/// One greedy request of `chat` through `engine`: (output ids, reused prompt tokens), or
/// the error.
async fn ask(
    engine: &slotstream::engine::Engine,
    chat: slotstream::chat_template::Chat,
    n: usize,
) -> Result<(Vec<u32>, usize), Error> {
    ask_text(engine, chat, n)
        .await
        .map(|(ids, reused, _)| (ids, reused))
}

/// [`ask`] with the reply's text.
async fn ask_text(
    engine: &slotstream::engine::Engine,
    chat: slotstream::chat_template::Chat,
    n: usize,
) -> Result<(Vec<u32>, usize, String), Error> {
    use futures::StreamExt;
    use slotstream::engine::{Event, Input, Request};
    let mut events = engine.generate(Request {
        input: Input::Chat(chat),
        max_tokens: n,
        sampling: Default::default(),
        logprobs: None,
        constraint: None,
    });
    let mut text = String::new();
    while let Some(e) = events.next().await {
        match e? {
            Event::Token { text: t, .. } => text.push_str(&t),
            Event::Done {
                output_ids,
                reused_tokens,
                tail,
                ..
            } => return Ok((output_ids, reused_tokens, text + &tail)),
        }
    }
    panic!("no Done event");
}

/// The same greedy tokens from the model directly: the template's ids with the image's
/// placeholder expanded, the tower's rows placed ([`Model::place_images`]).
fn direct_greedy(
    dir: &std::path::Path,
    chat: &slotstream::chat_template::Chat,
    n: usize,
) -> Vec<u32> {
    use slotstream::backend::cpu::CpuBackend;
    let engine = slotstream::engine::Engine::open(dir, Default::default()).unwrap();
    let ids = engine.encode_chat(chat).unwrap().ids;
    let l = crate::common::load_cpu(FIXTURE);
    let tower = slotstream::model::VisionTower::load(&l.ckpt).unwrap();
    let processor = ImageProcessor::from_dir(dir, tower.config()).unwrap();
    let images: Vec<_> = chat
        .images()
        .map(|i| {
            let p = processor
                .preprocess(&decode(&i.bytes, 1 << 24).unwrap())
                .unwrap();
            tower.embed(&p).unwrap()
        })
        .collect();
    let pad = tower.config().image_token_id;
    let mut next = images.iter();
    let ids: Vec<u32> = ids
        .iter()
        .flat_map(|&t| match (t == pad).then(|| next.next()).flatten() {
            Some(img) => vec![t; img.tokens()],
            None => vec![t],
        })
        .collect();
    let mut state = l.model.new_state(&CpuBackend);
    l.model.place_images(&mut state, &ids, &images).unwrap();
    let mut logits = l
        .model
        .forward(&CpuBackend, &mut state, &ids, &l.experts, Logits::Last)
        .unwrap();
    let mut out = Vec::new();
    for _ in 0..n {
        let t = crate::common::argmax(&logits);
        out.push(t);
        logits = l
            .model
            .forward(&CpuBackend, &mut state, &[t], &l.experts, Logits::Last)
            .unwrap();
    }
    out
}

/// An image through the engine, from a chat message: the tower is loaded on it, the
/// greedy tokens are the model's own with the image placed; the same image again
/// continues from the prompt cache (its whole prompt but the last token), a different
/// image of the same size (so of as many tokens) does not reuse the first one's state
/// past its placeholders and gets its own tokens; `--vision off`, a model without a tower
/// and a truncated image are refused with clear errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_takes_images_from_chat_messages_and_keys_their_reuse_by_pixels() {
    use slotstream::engine::{Engine, EngineOptions, VisionMode};
    let dir = crate::common::fixture_with_template(FIXTURE, IMAGE_TEMPLATE);
    let options = EngineOptions {
        device: Some("cpu".into()),
        ..Default::default()
    };
    let engine = Engine::load(dir.path(), options.clone()).await.unwrap();
    let png = std::fs::read(fixture_dir(FIXTURE).join("image1.png")).unwrap();
    let n = 6;
    let first = ask(&engine, image_chat(&png), n).await.unwrap();
    assert_eq!(first.0, direct_greedy(dir.path(), &image_chat(&png), n));
    assert_eq!(first.1, 0);
    let again = ask(&engine, image_chat(&png), n).await.unwrap();
    let prompt = engine.encode_chat(&image_chat(&png)).unwrap().ids;
    let pad_at = prompt.iter().position(|&t| t == 507).unwrap();
    assert_eq!(again.0, first.0);
    assert!(
        again.1 > pad_at,
        "the same image reuses the state past it: {}",
        again.1
    );

    // Another picture of the image's size: as many tokens, other pixels.
    let other = encode(
        &image::DynamicImage::ImageRgb8(random_rgb(160, 64)),
        image::ImageFormat::Png,
    );
    let got = ask(&engine, image_chat(&other), n).await.unwrap();
    assert!(
        got.1 <= pad_at,
        "reused {} tokens past the image at {pad_at}",
        got.1
    );
    assert_eq!(got.0, direct_greedy(dir.path(), &image_chat(&other), n));

    let off = Engine::load(
        dir.path(),
        EngineOptions {
            vision: VisionMode::Off,
            ..options.clone()
        },
    )
    .await
    .unwrap();
    let e = ask(&off, image_chat(&png), n)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("--vision off"), "{e}");
    let text_only = crate::common::fixture_with_template("qwen3_5-moe-bf16", IMAGE_TEMPLATE);
    let none = Engine::load(text_only.path(), options).await.unwrap();
    let e = ask(&none, image_chat(&png), n)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("no vision tower"), "{e}");
    let e = ask(&engine, image_chat(&png[..png.len() / 2]), n)
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Image(_)), "{e}");
}

/// An image through the server (OpenAI's chat endpoint, a data URL) gives the engine's own
/// reply for the same chat; a truncated image and an http URL are 400s with their reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn served_images_give_the_engines_reply() {
    use base64::Engine as _;
    let dir = crate::common::fixture_with_template(FIXTURE, IMAGE_TEMPLATE);
    let png = std::fs::read(fixture_dir(FIXTURE).join("image1.png")).unwrap();
    let engine = slotstream::engine::Engine::load(
        dir.path(),
        slotstream::engine::EngineOptions {
            device: Some("cpu".into()),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let (_, _, want) = ask_text(&engine, image_chat(&png), 6).await.unwrap();
    let s = crate::serve::start_on(dir.path(), 4096, 4, 0, None, false).await;
    let body = |url: String| {
        serde_json::json!({ "max_tokens": 6, "messages": [{ "role": "user", "content": [
            { "type": "image_url", "image_url": { "url": url } },
            { "type": "text", "text": "What is in the picture?" }] }] })
    };
    let b64 = |bytes: &[u8]| base64::engine::general_purpose::STANDARD.encode(bytes);
    let (status, v) = s
        .post(
            "/v1/chat/completions",
            &body(format!("data:image/png;base64,{}", b64(&png))),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], want.as_str());
    let cut = format!("data:image/png;base64,{}", b64(&png[..png.len() / 2]));
    let (status, v) = s.post("/v1/chat/completions", &body(cut)).await;
    assert_eq!(status, 400, "{v}");
    let (status, v) = s
        .post(
            "/v1/chat/completions",
            &body("https://example.com/a.png".into()),
        )
        .await;
    assert_eq!(status, 400, "{v}");
    assert!(v.to_string().contains("data: URL"), "{v}");
}

/// The memory plan sets the tower aside (`Footprint::vision`): its weights widened to f32
/// (the fixture's are bf16) and more for an image's activations; nothing for a text-only
/// checkpoint.
#[test]
fn the_memory_plan_charges_the_tower() {
    use slotstream::checkpoint::Checkpoint;
    let ckpt = Checkpoint::open(&fixture_dir(FIXTURE)).unwrap();
    let weights: u64 = (ckpt.tensors())
        .filter(|t| t.name.starts_with("vision_tower."))
        .map(|t| t.len * 2)
        .sum();
    let charged = slotstream::plan::vision_bytes(&ckpt);
    assert!(weights > 0 && charged > weights, "{charged} for {weights}");
    let text = Checkpoint::open(&fixture_dir("qwen3_5-moe-bf16")).unwrap();
    assert_eq!(slotstream::plan::vision_bytes(&text), 0);
}

/// `chat --image`: the first turn's reply is `generate --image`'s for the same message
/// (greedy), the image's tokens counted in its prompt; a second turn keeps the image in
/// the conversation and reuses the state past it.
#[test]
fn chat_takes_images_for_its_first_message() {
    let dir = crate::common::fixture_with_template(FIXTURE, IMAGE_TEMPLATE);
    let image = fixture_dir(FIXTURE).join("image1.png");
    let (model, image) = (dir.path().to_str().unwrap(), image.to_str().unwrap());
    let common = ["--model", model, "--temp", "0", "-n", "6"];
    let image_args = ["--image", image];
    let want = crate::serve::generate_json(
        &[&common[..], &image_args, &["--prompt", "Describe it."]].concat(),
    );
    let args = [
        &["chat", "--device", "cpu"][..],
        &common,
        &image_args,
        &["--stats"],
    ]
    .concat();
    let (ok, stdout, stderr) =
        crate::cli_families::with_stdin(&args, "Describe it.\nAnd again?\n/exit\n");
    assert!(ok, "{stderr}");
    let text = want["text"].as_str().unwrap();
    assert!(
        stdout.contains(text),
        "chat printed {stdout:?}, generate {text:?}"
    );
    let turns: Vec<(usize, usize)> = stderr
        .lines()
        .filter_map(|l| {
            let l = &l[l.find('[')? + 1..];
            let (new, rest) = l.split_once(" new prompt tokens, ")?;
            Some((
                new.parse().ok()?,
                rest.split_once(" reused")?.0.parse().ok()?,
            ))
        })
        .collect();
    assert_eq!(turns.len(), 2, "{stderr}");
    // The placeholder stands for the image's tokens, as the model's processor counts them.
    let processor = ImageProcessor::from_dir(dir.path(), &vision_config()).unwrap();
    let png = std::fs::read(fixture_dir(FIXTURE).join("image1.png")).unwrap();
    let tokens = (processor
        .preprocess(&decode(&png, 1 << 24).unwrap())
        .unwrap())
    .tokens;
    let placeholders = want["prompt_ids"].as_array().unwrap().len();
    assert_eq!(turns[0].0, placeholders - 1 + tokens, "{stderr}");
    assert!(
        turns[1].1 > turns[0].0,
        "the second turn reuses the first's state: {stderr}"
    );
}
