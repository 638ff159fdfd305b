//! Images to the vision tower's patches, as transformers 5.24.0's `Qwen2VLImageProcessor`
//! (the image processor of `qwen3_5_moe`) makes them: decode, convert to RGB (transparent
//! pixels over white, as its `convert_to_rgb`), resize so that each side is a multiple of
//! `patch_size * merge_size` with the pixel count within `[min_pixels, max_pixels]`
//! (`smart_resize`, bicubic), rescale to `[0, 1]`, normalize with the mean and std, and cut
//! into flattened patches of `temporal_patch_size` frames (a still image repeated), in
//! the order of the spatial merge (each square of `merge_size²` patches consecutive).
//!
//! The token counts equal the processor's for every size (`smart_resize` is followed
//! exactly, Python's round-half-to-even included). The resampling is the `image` crate's
//! Catmull-Rom bicubic, where the processor uses torchvision's antialiased bicubic: a
//! resized image's pixels differ from the processor's by a few levels of 255; an image
//! already at its target size is not resampled, and its patches are the processor's.
//!
//! Decoding is bounded: the dimensions are read from the header first and an image over
//! the pixel limit is refused before its pixels are decoded (a decompression bomb costs
//! its header), and the decoder's allocations are capped as well.

use std::io::Cursor;
use std::path::Path;

use image::{ImageFormat, ImageReader, Limits, RgbImage};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::config::VisionConfig;
use crate::error::{Error, Result};

/// The largest ratio of an image's long side to its short side the processor accepts
/// (`smart_resize`'s "absolute aspect ratio must be smaller than 200").
pub const MAX_ASPECT_RATIO: f64 = 200.0;

/// The processor's settings (`preprocessor_config.json`).
#[derive(Clone, Debug, PartialEq)]
pub struct ImageProcessor {
    /// Side of a patch in pixels (16).
    pub patch_size: usize,
    /// Frames of a patch (2).
    pub temporal_patch_size: usize,
    /// Side of the square of patches merged into one token (2).
    pub merge_size: usize,
    /// The fewest pixels a resized image has (`size.shortest_edge`; 65,536 released).
    pub min_pixels: usize,
    /// The most pixels a resized image has (`size.longest_edge`; here at most 2,304
    /// tokens' worth, 2,359,296 pixels, the reference system's bound).
    pub max_pixels: usize,
    /// Per-channel mean subtracted after rescaling to `[0, 1]` (0.5 each).
    pub image_mean: [f32; 3],
    /// Per-channel std divided by after the mean (0.5 each).
    pub image_std: [f32; 3],
}

/// An image's grid of patches: `t` frames of patch rows `h` by patch columns `w`
/// (transformers' `image_grid_thw`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grid {
    pub t: usize,
    pub h: usize,
    pub w: usize,
}

impl Grid {
    /// Patches in the grid (`t h w`): the tower's rows before the merger.
    pub fn patches(&self) -> usize {
        self.t * self.h * self.w
    }
}

/// An image ready for the tower: its grid and its flattened patches.
#[derive(Clone, Debug, PartialEq)]
pub struct Patches {
    pub grid: Grid,
    /// `[grid.patches(), channels * temporal_patch_size * patch_size²]` row-major, each
    /// row ordered (channel, frame, row, column) as the processor's `pixel_values`.
    pub values: Vec<f32>,
    /// The image's tokens after the merger (`patches / merge_size²`).
    pub tokens: usize,
}

impl Patches {
    /// The image's identity for prompt reuse: the first 8 bytes of the SHA-256 of its grid
    /// and patch values (its pixels as the tower sees them), so the same picture gives the
    /// same key and a different one with the same token count another.
    pub fn key(&self) -> u64 {
        let mut h = Sha256::new();
        for side in [self.grid.t, self.grid.h, self.grid.w] {
            h.update((side as u64).to_le_bytes());
        }
        h.update(bytemuck::cast_slice::<f32, u8>(&self.values));
        let digest = h.finalize();
        u64::from_le_bytes(digest[..8].try_into().unwrap_or_default())
    }
}

impl ImageProcessor {
    /// The released settings for a tower of `vision`'s patch sizes: min 65,536 pixels
    /// (64 tokens), max 2,304 tokens' worth, mean and std 0.5.
    pub fn for_tower(vision: &VisionConfig) -> Self {
        let token_side = vision.patch_size * vision.spatial_merge_size;
        ImageProcessor {
            patch_size: vision.patch_size,
            temporal_patch_size: vision.temporal_patch_size,
            merge_size: vision.spatial_merge_size,
            min_pixels: 65_536,
            max_pixels: 2_304 * token_side * token_side,
            image_mean: [0.5; 3],
            image_std: [0.5; 3],
        }
    }

    /// [`ImageProcessor::for_tower`] with what `dir/preprocessor_config.json` sets, where
    /// it exists: `size.shortest_edge` / `size.longest_edge` (or `min_pixels` /
    /// `max_pixels`), `image_mean`, `image_std`. Its patch sizes must be the tower's.
    /// Errors: an unreadable or malformed file, a patch size that is not the tower's.
    pub fn from_dir(dir: &Path, vision: &VisionConfig) -> Result<Self> {
        let mut p = Self::for_tower(vision);
        let path = dir.join("preprocessor_config.json");
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(p),
            Err(e) => return Err(Error::io(&path, e)),
        };
        let bad = |field: &str, message: String| Error::Config {
            path: path.clone(),
            field: field.into(),
            message,
        };
        let root: Value = serde_json::from_str(&text).map_err(|e| Error::Json {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let count = |v: Option<&Value>, field: &str| -> Result<Option<usize>> {
            match v {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v
                    .as_u64()
                    .filter(|&n| n > 0)
                    .map(|n| Some(n as usize))
                    .ok_or_else(|| bad(field, format!("expected a positive integer, found {v}"))),
            }
        };
        let size = root.get("size");
        if let Some(n) = count(
            size.and_then(|s| s.get("shortest_edge")),
            "size.shortest_edge",
        )?
        .or(count(root.get("min_pixels"), "min_pixels")?)
        {
            p.min_pixels = n;
        }
        if let Some(n) = count(
            size.and_then(|s| s.get("longest_edge")),
            "size.longest_edge",
        )?
        .or(count(root.get("max_pixels"), "max_pixels")?)
        {
            p.max_pixels = n;
        }
        for (field, want) in [
            ("patch_size", vision.patch_size),
            ("temporal_patch_size", vision.temporal_patch_size),
            ("merge_size", vision.spatial_merge_size),
        ] {
            if let Some(n) = count(root.get(field), field)? {
                if n != want {
                    return Err(bad(field, format!("{n}, but the vision tower's is {want}")));
                }
            }
        }
        for (field, out) in [
            ("image_mean", &mut p.image_mean),
            ("image_std", &mut p.image_std),
        ] {
            match root.get(field) {
                None | Some(Value::Null) => {}
                Some(Value::Array(v)) if v.len() == 3 && v.iter().all(Value::is_number) => {
                    for (o, x) in out.iter_mut().zip(v) {
                        *o = x.as_f64().unwrap_or_default() as f32;
                    }
                }
                Some(v) => return Err(bad(field, format!("expected 3 numbers, found {v}"))),
            }
        }
        if p.image_std.contains(&0.0) {
            return Err(bad("image_std", "a std of 0".into()));
        }
        if p.min_pixels > p.max_pixels {
            return Err(bad(
                "size",
                format!(
                    "min pixels {} above max pixels {}",
                    p.min_pixels, p.max_pixels
                ),
            ));
        }
        Ok(p)
    }

    /// `(height, width)` an image of `height x width` pixels is resized to
    /// (transformers `smart_resize` with `factor = patch_size * merge_size`): each side
    /// rounded to a multiple of the factor (half to even, as Python's `round`), then
    /// scaled down to at most `max_pixels` or up to at least `min_pixels`, keeping the
    /// aspect ratio as closely as the factor allows.
    /// Errors: [`Error::Image`] for an empty image or an aspect ratio over 200.
    pub fn resized_size(&self, height: usize, width: usize) -> Result<(usize, usize)> {
        if height == 0 || width == 0 {
            return Err(Error::Image(format!(
                "the image is empty ({width}x{height})"
            )));
        }
        let (h, w) = (height as f64, width as f64);
        let ratio = h.max(w) / h.min(w);
        if ratio > MAX_ASPECT_RATIO {
            return Err(Error::Image(format!(
                "a {width}x{height} image's aspect ratio {ratio:.2} is over {MAX_ASPECT_RATIO}"
            )));
        }
        let factor = (self.patch_size * self.merge_size) as f64;
        let mut h_bar = (h / factor).round_ties_even() * factor;
        let mut w_bar = (w / factor).round_ties_even() * factor;
        if h_bar * w_bar > self.max_pixels as f64 {
            let beta = (h * w / self.max_pixels as f64).sqrt();
            h_bar = factor.max((h / beta / factor).floor() * factor);
            w_bar = factor.max((w / beta / factor).floor() * factor);
        } else if h_bar * w_bar < self.min_pixels as f64 {
            let beta = (self.min_pixels as f64 / (h * w)).sqrt();
            h_bar = (h * beta / factor).ceil() * factor;
            w_bar = (w * beta / factor).ceil() * factor;
        }
        Ok((h_bar as usize, w_bar as usize))
    }

    /// The grid of an image of `height x width` pixels (one frame).
    /// Errors: as [`ImageProcessor::resized_size`].
    pub fn grid(&self, height: usize, width: usize) -> Result<Grid> {
        let (h, w) = self.resized_size(height, width)?;
        Ok(Grid {
            t: 1,
            h: h / self.patch_size,
            w: w / self.patch_size,
        })
    }

    /// Resizes, normalizes and patchifies `image`.
    /// Errors: as [`ImageProcessor::resized_size`].
    pub fn preprocess(&self, image: &RgbImage) -> Result<Patches> {
        let (height, width) = (image.height() as usize, image.width() as usize);
        let (rh, rw) = self.resized_size(height, width)?;
        let resized;
        let image = if (rh, rw) == (height, width) {
            image
        } else {
            resized = image::imageops::resize(
                image,
                rw as u32,
                rh as u32,
                image::imageops::FilterType::CatmullRom,
            );
            &resized
        };
        let (p, m, frames) = (self.patch_size, self.merge_size, self.temporal_patch_size);
        let grid = Grid {
            t: 1,
            h: rh / p,
            w: rw / p,
        };
        // The processor rescales and normalizes in one step: (v / 255 - mean) / std.
        let scale: [f32; 3] = std::array::from_fn(|c| 1.0 / (255.0 * self.image_std[c]));
        let shift: [f32; 3] = std::array::from_fn(|c| self.image_mean[c] / self.image_std[c]);
        let row_len = 3 * frames * p * p;
        let mut values = Vec::with_capacity(grid.patches() * row_len);
        for bh in 0..grid.h / m {
            for bw in 0..grid.w / m {
                for mh in 0..m {
                    for mw in 0..m {
                        let (y0, x0) = ((bh * m + mh) * p, (bw * m + mw) * p);
                        for c in 0..3 {
                            for _ in 0..frames {
                                for y in y0..y0 + p {
                                    for x in x0..x0 + p {
                                        let v = image.get_pixel(x as u32, y as u32)[c] as f32;
                                        values.push(v * scale[c] - shift[c]);
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        Ok(Patches {
            grid,
            values,
            tokens: grid.patches() / (m * m),
        })
    }
}

/// Decodes a PNG, JPEG, WebP or GIF (its first frame) to RGB; transparent pixels are
/// composited over white. An image of more than `max_pixels` pixels is refused from its
/// header, before any pixel is decoded, and the decoder may allocate at most about what
/// such an image needs.
/// Errors: [`Error::Image`]: not one of these formats, a truncated or corrupt file, more
/// than `max_pixels` pixels.
pub fn decode(bytes: &[u8], max_pixels: u64) -> Result<RgbImage> {
    let reader = || -> Result<ImageReader<Cursor<&[u8]>>> {
        let reader = ImageReader::new(Cursor::new(bytes))
            .with_guessed_format()
            .map_err(|e| Error::Image(format!("cannot read the image: {e}")))?;
        match reader.format() {
            Some(ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::WebP | ImageFormat::Gif) => {
                Ok(reader)
            }
            Some(other) => Err(Error::Image(format!(
                "{other:?} images are not supported (PNG, JPEG, WebP or GIF)"
            ))),
            None => Err(Error::Image(
                "not an image (expected PNG, JPEG, WebP or GIF)".into(),
            )),
        }
    };
    let (width, height) = reader()?
        .into_dimensions()
        .map_err(|e| Error::Image(format!("cannot read the image's header: {e}")))?;
    let pixels = width as u64 * height as u64;
    if pixels > max_pixels {
        return Err(Error::Image(format!(
            "the image is {width}x{height}, {:.1} megapixels: over the limit of {:.1}",
            pixels as f64 / 1e6,
            max_pixels as f64 / 1e6
        )));
    }
    let mut limits = Limits::default();
    limits.max_image_width = Some(width);
    limits.max_image_height = Some(height);
    // 16-bit RGBA plus a converted copy, and room for the decoders' own buffers.
    limits.max_alloc = Some(pixels * 16 + (64 << 20));
    let mut reader = reader()?;
    reader.limits(limits);
    let image = reader
        .decode()
        .map_err(|e| Error::Image(format!("cannot decode the image: {e}")))?;
    if !image.color().has_alpha() {
        return Ok(image.to_rgb8());
    }
    let rgba = image.to_rgba8();
    Ok(RgbImage::from_fn(width, height, |x, y| {
        let [r, g, b, a] = rgba.get_pixel(x, y).0;
        let over_white = |c: u8| ((c as u32 * a as u32 + 255 * (255 - a as u32) + 127) / 255) as u8;
        image::Rgb([over_white(r), over_white(g), over_white(b)])
    }))
}
