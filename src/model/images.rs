//! Images in a sequence: the vision tower's rows put in place of an image's placeholder
//! tokens (`<|image_pad|>`, one per merged token), and the multimodal rotary positions
//! (M-RoPE) of every token, as transformers 5.24 `Qwen3_5MoeModel.get_rope_index`
//! computes them for `qwen3_5_moe`:
//!
//! - text tokens advance the three axes (t, h, w) together, one position a token;
//! - an image's tokens, on its merged grid of `t x h x w`, start at the position `p` the
//!   next text token would have had and take `(p + frame, p + row, p + column)`;
//! - the text after an image continues at `p + max(h, w)` (the largest position the image
//!   took, plus one), not at `p + t h w`: a sequence's next position is not its token count.

use std::sync::Arc;

use crate::error::{Error, Result};

/// An image's tokens as the language model takes them: the vision tower's merged rows
/// (`VisionTower::forward`) and the grid they lie on.
#[derive(Clone, Debug, PartialEq)]
pub struct ImageEmbedding {
    /// The merged grid `[t, h, w]` (the processor's grid with h and w divided by the
    /// spatial merge size); the image has `t * h * w` tokens, row-major.
    pub grid: [usize; 3],
    /// `[t * h * w, hidden_size]` f32, row-major: one row per placeholder token.
    pub rows: Arc<[f32]>,
    /// The image's identity: a hash of its pixels as the tower saw them
    /// (`Patches::key`). Prompt reuse compares it, since every image's placeholders are
    /// the same token.
    pub key: u64,
}

/// Where an image lies in a sequence and which it is, for prompt reuse: a snapshot
/// continues a prompt only where their images are the same ones at the same places.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImageSpan {
    /// Sequence index of the image's first token.
    pub at: usize,
    /// Its tokens.
    pub tokens: usize,
    /// [`ImageEmbedding::key`].
    pub key: u64,
}

impl ImageEmbedding {
    /// The image's tokens (`t * h * w`).
    pub fn tokens(&self) -> usize {
        self.grid.iter().product()
    }

    /// Positions the image advances the sequence by: `max(h, w)` (transformers'
    /// `current_pos += max(grid_h, grid_w) // spatial_merge_size`).
    fn span(&self) -> usize {
        self.grid[1].max(self.grid[2])
    }
}

/// An image placed in a sequence: its tokens are the sequence's `at .. at + tokens()`.
#[derive(Clone, Debug)]
pub(super) struct PlacedImage {
    pub(super) at: usize,
    pub(super) image: ImageEmbedding,
}

impl PlacedImage {
    fn end(&self) -> usize {
        self.at + self.image.tokens()
    }

    pub(super) fn span(&self) -> ImageSpan {
        ImageSpan {
            at: self.at,
            tokens: self.image.tokens(),
            key: self.image.key,
        }
    }
}

/// The (t, h, w) positions of the sequence's tokens `from .. from + n`, or `None` when the
/// sequence has no image (every position is then its index, and plain RoPE applies).
/// `images` are in sequence order.
pub(super) fn positions(images: &[PlacedImage], from: usize, n: usize) -> Option<Vec<[usize; 3]>> {
    if images.is_empty() {
        return None;
    }
    let mut out = Vec::with_capacity(n);
    // `shift`: what the images wholly before index `i` add to its position
    // (`span - tokens`, negative for all but one-row images), as a signed offset.
    let (mut next, mut shift) = (0usize, 0isize);
    for i in from..from + n {
        while let Some(img) = images.get(next).filter(|img| img.end() <= i) {
            shift += img.image.span() as isize - img.image.tokens() as isize;
            next += 1;
        }
        match images.get(next).filter(|img| img.at <= i) {
            Some(img) => {
                let start = (img.at as isize + shift) as usize;
                let [_, h, w] = img.image.grid;
                let k = i - img.at;
                out.push([start + k / (h * w), start + (k / w) % h, start + k % w]);
            }
            None => {
                let p = (i as isize + shift) as usize;
                out.push([p; 3]);
            }
        }
    }
    Some(out)
}

/// The position the token after the first `len` of the sequence takes if it is text: `len`
/// plus what every image wholly before it adds (`max(h, w) - t h w` each).
pub(super) fn next_position(images: &[PlacedImage], len: usize) -> usize {
    images
        .iter()
        .filter(|img| img.end() <= len)
        .fold(len as isize, |p, img| {
            p + img.image.span() as isize - img.image.tokens() as isize
        }) as usize
}

/// Whether any image token lies in the sequence's `from .. from + n`.
pub(super) fn overlaps(images: &[PlacedImage], from: usize, n: usize) -> bool {
    images
        .iter()
        .any(|img| img.at < from + n && img.end() > from)
}

/// Writes the image rows of the sequence's tokens `from ..` over their rows of `embedded`
/// (`[n, width]` row-major: the chunk's embeddings).
pub(super) fn splice(images: &[PlacedImage], from: usize, width: usize, embedded: &mut [f32]) {
    let n = embedded.len() / width;
    for img in images {
        let (lo, hi) = (img.at.max(from), img.end().min(from + n));
        for i in lo..hi {
            let k = i - img.at;
            embedded[(i - from) * width..][..width]
                .copy_from_slice(&img.image.rows[k * width..][..width]);
        }
    }
}

/// Places `images`, in order, over the runs of `image_token` in `ids` (the tokens a
/// sequence of `len` tokens runs next): each run holds one image's tokens or several
/// images' back to back. Errors ([`Error::InvalidInput`]): a run whose length is not the
/// tokens of the images placed in it, more runs than images or the other way round, an
/// image whose rows are not `tokens x width`.
pub(super) fn place(
    ids: &[u32],
    len: usize,
    image_token: u32,
    width: usize,
    images: &[ImageEmbedding],
) -> Result<Vec<PlacedImage>> {
    let bad = |m: String| Error::InvalidInput(m);
    for (n, img) in images.iter().enumerate() {
        if img.tokens() == 0 || img.rows.len() != img.tokens() * width {
            return Err(bad(format!(
                "image {n}: {} values for a {:?} grid of rows of {width}",
                img.rows.len(),
                img.grid
            )));
        }
    }
    let mut placed = Vec::with_capacity(images.len());
    let mut next = images.iter();
    let mut i = 0;
    while i < ids.len() {
        if ids[i] != image_token {
            i += 1;
            continue;
        }
        let run = ids[i..].iter().take_while(|&&t| t == image_token).count();
        let mut filled = 0;
        while filled < run {
            let Some(img) = next.next() else {
                return Err(bad(format!(
                    "the prompt has more image placeholder tokens than the {} images' tokens",
                    images.len()
                )));
            };
            placed.push(PlacedImage {
                at: len + i + filled,
                image: img.clone(),
            });
            filled += img.tokens();
        }
        if filled != run {
            return Err(bad(format!(
                "a run of {run} image placeholder tokens does not fit the images' token counts"
            )));
        }
        i += run;
    }
    if placed.len() != images.len() {
        return Err(bad(format!(
            "{} images for {} image placeholders in the prompt",
            images.len(),
            placed.len()
        )));
    }
    Ok(placed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(grid: [usize; 3]) -> ImageEmbedding {
        let n: usize = grid.iter().product();
        ImageEmbedding {
            grid,
            rows: (0..n * 2).map(|v| v as f32).collect(),
            key: n as u64,
        }
    }

    /// transformers' `get_rope_index` on text (5), an image on a 2 x 5 grid, text (6),
    /// a 1 x 1 image, text (4) (the fixture's prompt, tests/fixtures/qwen3_5-moe-vision).
    #[test]
    fn positions_follow_get_rope_index() {
        let mut ids = vec![1u32; 6];
        ids.extend([9; 10]);
        ids.extend([1; 6]);
        ids.push(9);
        ids.extend([1; 4]);
        let placed = place(&ids, 0, 9, 2, &[image([1, 2, 5]), image([1, 1, 1])]).unwrap();
        let p = positions(&placed, 0, ids.len()).unwrap();
        let axis = |a: usize| p.iter().map(|p| p[a]).collect::<Vec<_>>();
        let t = [
            0, 1, 2, 3, 4, 5, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 11, 12, 13, 14, 15, 16, 17, 18,
        ];
        let h = [
            0, 1, 2, 3, 4, 5, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 11, 12, 13, 14, 15, 16, 17, 18,
        ];
        let w = [
            0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18,
        ];
        assert_eq!(axis(0)[..24], t);
        assert_eq!(axis(1)[..24], h);
        assert_eq!(axis(2)[..24], w);
        assert_eq!(p[26], [21; 3]);
        assert_eq!(next_position(&placed, ids.len()), 22);
        // Any window gives the same positions as the whole.
        for from in 0..ids.len() {
            for n in 1..=ids.len() - from {
                assert_eq!(positions(&placed, from, n).unwrap(), p[from..from + n]);
            }
        }
        assert_eq!(positions(&[], 3, 2), None);
    }

    /// A text row's M-RoPE angles are plain RoPE's, bit for bit, in either layout.
    #[test]
    fn text_positions_rotate_as_plain_rope() {
        use crate::backend::{mrope_table, rope_table};
        use crate::config::MRope;
        for interleaved in [true, false] {
            let mrope = MRope {
                section: [11, 11, 10],
                interleaved,
            };
            let at: Vec<[usize; 3]> = (4000..4100).map(|p| [p; 3]).collect();
            let got = mrope_table(&at, 64, 1e7, &mrope);
            assert_eq!(got, rope_table(4000, 100, 64, 1e7));
        }
    }

    #[test]
    fn splice_writes_only_image_rows() {
        let ids = [1, 9, 9, 1];
        let placed = place(&ids, 10, 9, 2, &[image([1, 1, 2])]).unwrap();
        assert_eq!(placed[0].at, 11);
        let mut rows = vec![-1.0; 6];
        splice(&placed, 12, 2, &mut rows);
        assert_eq!(rows, [2.0, 3.0, -1.0, -1.0, -1.0, -1.0]);
        assert!(overlaps(&placed, 12, 3) && !overlaps(&placed, 13, 5));
    }

    #[test]
    fn placement_refuses_counts_that_do_not_fit() {
        let ids = [1, 9, 9, 9, 1];
        assert!(place(&ids, 0, 9, 2, &[image([1, 1, 2])]).is_err());
        assert!(place(&ids, 0, 9, 2, &[]).is_err());
        assert!(place(&ids, 0, 9, 2, &[image([1, 1, 3]), image([1, 1, 1])]).is_err());
        assert!(place(&ids, 0, 9, 2, &[image([1, 1, 1]), image([1, 1, 2])]).is_ok());
        let mut short = image([1, 1, 3]);
        short.rows = Arc::from(vec![0.0; 5]);
        assert!(place(&ids, 0, 9, 2, &[short]).is_err());
    }
}
