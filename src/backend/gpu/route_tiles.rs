//! A chunk's routes grouped by expert on the device (`wgsl/route_tiles.wgsl`), for the
//! tiled routed matmuls when every record of the layer is resident: a prefill then never
//! waits for its routing to be read back between layers.

use super::device::{uniform_block, Access, Bind, Kernel};
use super::{GpuBackend, GpuTensor};

const ROUTE_TILES: Kernel = Kernel::new(
    "route_tiles.wgsl",
    "route_tiles",
    &[Access::Read, Access::Read, Access::ReadWrite],
);

uniform_block! {
    /// `Params` of `wgsl/route_tiles.wgsl`.
    pub(super) struct RouteTileParams {
        routes: u32,
        experts: u32,
        capacity: u32,
        tile: u32,
    }
}

/// Largest expert table the shader holds (`MAX_EXPERTS` in `wgsl/route_tiles.wgsl`).
const MAX_EXPERTS: usize = 1024;

/// One arena's tiles in a [`DeviceTiles`] list: entries `first .. first + capacity`,
/// the ones its experts leave empty holding no routes.
pub(super) struct TileRange {
    pub arena: usize,
    pub first: usize,
    pub capacity: usize,
}

/// A tile list built on the device, in the format of the tiled entries' routed = 4
/// (`wgsl/quant.wgsl`): `capacity` tile entries, then the route list.
pub(super) struct DeviceTiles {
    pub list: GpuTensor,
    pub capacity: usize,
    pub ranges: Vec<TileRange>,
}

/// Groups the `routes` routes whose expert ids `ids` binds (`[T, k]` u32) into tiles of
/// at most `tile` routes of one expert, expert `e`'s record lying at `places[e]` (arena,
/// base in u32 words), `arenas` the arenas `places` names, sorted and distinct. An arena's range has room for `routes / tile` full tiles plus a
/// partial one per expert it holds. `None` when the layer has more experts than the
/// shader holds, or a range would need more workgroups than a grid dimension allows.
pub(super) fn route_tiles(
    b: &GpuBackend,
    ids: Bind<'_>,
    routes: usize,
    places: &[(usize, u32)],
    arenas: &[usize],
    tile: usize,
) -> Option<DeviceTiles> {
    let experts = places.len();
    if experts == 0 || experts > MAX_EXPERTS {
        return None;
    }
    let range_of = |arena: usize| arenas.binary_search(&arena).unwrap_or_default();
    let mut ranges = Vec::with_capacity(arenas.len());
    let mut capacity = 0;
    for &arena in arenas {
        let held = places.iter().filter(|p| p.0 == arena).count();
        let room = routes / tile + held;
        if room > b.gpu.limits.max_compute_workgroups_per_dimension as usize {
            return None;
        }
        ranges.push(TileRange {
            arena,
            first: capacity,
            capacity: room,
        });
        capacity += room;
    }
    let mut order: Vec<u32> = (0..experts as u32).collect();
    order.sort_by_key(|&e| range_of(places[e as usize].0));
    let plan: Vec<u32> = places
        .iter()
        .flat_map(|&(arena, base)| [range_of(arena) as u32, base])
        .chain(order)
        .chain(ranges.iter().map(|r| r.first as u32))
        .collect();
    let list = b.empty(1, 4 * capacity + routes);
    b.gpu.dispatch_with(
        &ROUTE_TILES,
        &RouteTileParams {
            routes: routes as u32,
            experts: experts as u32,
            capacity: capacity as u32,
            tile: tile as u32,
        },
        &[
            ids,
            Bind::Data(bytemuck::cast_slice(&plan)),
            Bind::Buffer(&list.buf),
        ],
        [1, 1, 1],
    );
    Some(DeviceTiles {
        list,
        capacity,
        ranges,
    })
}
