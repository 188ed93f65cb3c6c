/* compare_mapped: one layer's batch compared with both sides' rows read where they lie in
 * the dumps' file mappings (included once by _element_errors.c, after compare). Python
 * (kvaudit/numeric/mapped_rows.py) says where each (head, token) row's parts are: a mapping and a
 * byte offset; every held row's parts are checked against their mapping's bounds here,
 * before the loop, so that a wrong location raises ValueError instead of reading outside.
 * No copy of the rows is made: the loop decodes them from the page cache. */

/* Rows read in place map the large folio of page cache around them (up to 2 MiB, a PMD,
 * on x86-64 and arm64 with transparent huge pages), counted in the process's RSS until
 * released. The regions of that size holding rows read are marked as touched; once the
 * touched regions reach the call's release budget (checked after each chunk of tokens),
 * and at the end of the call, they are released (MADV_DONTNEED), each run of adjacent
 * ones in one call. Releasing after every chunk instead kept less resident but cost
 * about as much CPU as the comparison: a request's blocks lie in random regions, so each
 * chunk faulted most of a layer's regions in again (and each release is a TLB flush on
 * every core the process runs on). Pages released are read again from the page cache if
 * touched again. */
#define REGION ((int64_t)2 << 20)

static void release_maps(Maps *maps)
{
    for (Py_ssize_t i = 0; i < maps->count; i++)
        PyBuffer_Release(&maps->views[i]);
    PyMem_Free(maps->views);
    PyMem_Free(maps->bases);
    PyMem_Free(maps->first_region);
    PyMem_Free(maps->touched);
    maps->count = 0;
}

/* The buffers of a sequence of mappings (mmap objects, ctypes arrays: any object with a
 * contiguous buffer), and room to mark their touched regions. */
static int take_maps(PyObject *sequence, Maps *maps)
{
    PyObject *items = PySequence_Fast(sequence, "maps must be a sequence of buffers");
    if (items == NULL)
        return 0;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(items);
    maps->views = PyMem_Calloc((size_t)count + 1, sizeof(Py_buffer));
    maps->bases = PyMem_Calloc((size_t)count + 1, sizeof(uint8_t *));
    maps->first_region = PyMem_Calloc((size_t)count + 1, sizeof(int64_t));
    if (maps->views == NULL || maps->bases == NULL || maps->first_region == NULL) {
        Py_DECREF(items);
        PyErr_NoMemory();
        return 0;
    }
    for (; maps->count < count; maps->count++) {
        Py_buffer *view = &maps->views[maps->count];
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(items, maps->count), view,
                               PyBUF_SIMPLE) < 0) {
            Py_DECREF(items);
            return 0;
        }
        maps->bases[maps->count] = view->buf;
        maps->first_region[maps->count + 1] =
            maps->first_region[maps->count] + (view->len + REGION - 1) / REGION;
    }
    Py_DECREF(items);
    maps->touched = PyMem_Calloc((size_t)maps->first_region[count] + 1, 1);
    if (maps->touched == NULL) {
        PyErr_NoMemory();
        return 0;
    }
    return 1;
}

/* A side's parts, ((start, width), ...): they must tile the row's elements in order. */
static int take_parts(Side *side, PyObject *parts, Py_ssize_t elements)
{
    PyObject *items = PySequence_Fast(parts, "parts must be a sequence of (start, width)");
    if (items == NULL)
        return 0;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(items), end = 0;
    int ok = count >= 1 && count <= MAX_PARTS;
    for (Py_ssize_t e = 0; ok && e < count; e++) {
        Py_ssize_t start, width;
        ok = PyArg_ParseTuple(PySequence_Fast_GET_ITEM(items, e), "nn", &start, &width);
        if (!ok) {
            Py_DECREF(items);
            return 0;
        }
        ok = start == end && width >= 1;
        side->part_start[e] = start;
        side->part_width[e] = width;
        end = start + width;
    }
    Py_DECREF(items);
    if (!ok || end != elements) {
        PyErr_SetString(PyExc_ValueError, "the parts do not tile a row's elements in order");
        return 0;
    }
    side->parts = (int)count;
    return 1;
}

/* Whether every held row's parts lie inside their mappings; ValueError naming the first
 * that does not. */
static int check_where(const Side *side, const Batch *b, const Maps *maps)
{
    Py_ssize_t rows = b->heads * b->tokens;
    for (int e = 0; e < side->parts; e++) {
        Py_ssize_t bytes = side->part_width[e] * KIND_SIZES[side->kind];
        for (Py_ssize_t row = 0; row < rows; row++) {
            if (!b->held[row])
                continue;
            const int64_t *at = side->where + 2 * (e * rows + row);
            if (at[0] < 0 || at[0] >= maps->count || at[1] < 0 ||
                at[1] > maps->views[at[0]].len - bytes) {
                PyErr_Format(PyExc_ValueError,
                             "head %zd token %zd: part %d (map %lld, offset %lld, %zd bytes) "
                             "lies outside the mappings",
                             row / b->tokens, row % b->tokens, e, (long long)at[0],
                             (long long)at[1], bytes);
                return 0;
            }
        }
    }
    return 1;
}

/* Release (MADV_DONTNEED) the touched regions, a call per run of adjacent ones, and mark
 * them untouched; only page-aligned mappings (a file's, from its start) are released. */
static void release_touched(Maps *maps)
{
    for (Py_ssize_t m = 0; m < maps->count; m++) {
        uint8_t *touched = maps->touched + maps->first_region[m];
        int64_t regions = maps->first_region[m + 1] - maps->first_region[m];
        int aligned = (uintptr_t)maps->bases[m] % 4096 == 0;
        for (int64_t r = 0; r < regions; r++) {
            if (!touched[r])
                continue;
            int64_t run = r;
            while (run < regions && touched[run])
                touched[run++] = 0;
#ifdef MADV_DONTNEED
            int64_t start = r * REGION, length = maps->views[m].len;
            int64_t end = run * REGION < length ? run * REGION : length;
            if (aligned)
                madvise((void *)(maps->bases[m] + start), (size_t)(end - start), MADV_DONTNEED);
#else
            (void)aligned;
#endif
            r = run;
        }
    }
    maps->touched_count = 0;
}

/* Mark the regions holding both sides' held rows of heads h0 .. h1 - 1 and tokens
 * first .. end - 1 as touched, and release all touched ones once they reach the batch's
 * budget. */
static void mark_rows_read(const Batch *b, Py_ssize_t h0, Py_ssize_t h1, Py_ssize_t first,
                           Py_ssize_t end)
{
    Maps *maps = b->maps;
    Py_ssize_t rows = b->heads * b->tokens;
    for (int s = 0; s < 2; s++) {
        const Side *side = &b->sides[s];
        for (int e = 0; side->bits == NULL && e < side->parts; e++) {
            int64_t bytes = side->part_width[e] * KIND_SIZES[side->kind];
            for (Py_ssize_t h = h0; h < h1; h++)
                for (Py_ssize_t t = first; t < end; t++) {
                    Py_ssize_t row = h * b->tokens + t;
                    if (!b->held[row])
                        continue;
                    const int64_t *at = side->where + 2 * (e * rows + row);
                    uint8_t *touched = maps->touched + maps->first_region[at[0]];
                    for (int64_t r = at[1] / REGION; r <= (at[1] + bytes - 1) / REGION; r++) {
                        maps->touched_count += !touched[r];
                        touched[r] = 1;
                    }
                }
        }
    }
    if (maps->touched_count * REGION >= b->release)
        release_touched(maps);
}

PyDoc_STRVAR(compare_mapped_doc,
    "compare_mapped(maps, p_where, c_where, held, shape, p_side, c_side, tolerance, lo,\n"
    "               chunk, release, figures, counts, worst_error, worst_position, token_row\n"
    "               [, head_ratio, token_ratio])\n"
    "--\n\n"
    "compare() with both sides' rows read in place: maps a sequence of buffers (the dumps'\n"
    "mappings), each side (kind, head_size, K scale, V scale, parts) with parts ((start,\n"
    "width), ...) tiling a row's elements, and p_where, c_where int64 [parts, heads,\n"
    "tokens, 2]: the index in maps and the byte offset of each row's part. Every held row's\n"
    "parts are checked to lie inside their mapping first (ValueError if not). The rows go\n"
    "chunk tokens at a time, token by token within a chunk where heads_inner (else head\n"
    "by head); release: bytes, the 2 MiB regions of the maps holding rows read are\n"
    "released (MADV_DONTNEED) once they reach these bytes (checked after each chunk) and\n"
    "at the end (0: never; only for maps that are file mappings).");

static PyObject *compare_mapped(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *map_list, *kinds[2], *parts[2];
    Py_buffer in[3], out[7];
    Batch b;
    Maps maps = {0, NULL, NULL, NULL, NULL, 0};
    memset(&b, 0, sizeof b);
    memset(out, 0, sizeof out);
    Side *p = &b.sides[0], *c = &b.sides[1];
    if (!PyArg_ParseTuple(args, "Oy*y*y*(nnn)(UnddO)(UnddO)(dd)n(nnp)w*w*w*w*w*|w*w*", &map_list,
                          &in[0], &in[1], &in[2], &b.heads, &b.tokens, &b.elements, &kinds[0],
                          &p->head_size, &p->scales[0], &p->scales[1], &parts[0], &kinds[1],
                          &c->head_size, &c->scales[0], &c->scales[1], &parts[1], &b.atol,
                          &b.rtol, &b.lo, &b.chunk, &b.release, &b.heads_inner, &out[0], &out[1], &out[2],
                          &out[3], &out[4], &out[5], &out[6]))
        return NULL;
    PyObject *result = NULL;
    if (!take_kind(p, kinds[0]) || !take_kind(c, kinds[1]) || !check_shape(&b))
        goto done;
    if (!take_parts(p, parts[0], b.elements) || !take_parts(c, parts[1], b.elements))
        goto done;
    Py_ssize_t rows = b.heads * b.tokens;
    Py_ssize_t want[3] = {p->parts * rows * 16, c->parts * rows * 16, rows};
    if (!check_lengths(in, want, 3, 0) || !take_outputs(&b, out) || !take_maps(map_list, &maps))
        goto done;
    b.held = in[2].buf;
    b.maps = &maps;
    for (int s = 0; s < 2; s++) {
        b.sides[s].where = in[s].buf;
        if (!check_where(&b.sides[s], &b, &maps))
            goto done;
    }
    if (b.release < 0) {
        PyErr_SetString(PyExc_ValueError, "release must be at least 0");
        goto done;
    }
    result = run_batch(&b);
    if (b.release > 0 && maps.touched_count > 0) {
        Py_BEGIN_ALLOW_THREADS
        release_touched(&maps);
        Py_END_ALLOW_THREADS
    }
done:
    release_maps(&maps);
    for (int i = 0; i < 3; i++)
        PyBuffer_Release(&in[i]);
    for (int i = 0; i < 7; i++)
        PyBuffer_Release(&out[i]);
    return result;
}
