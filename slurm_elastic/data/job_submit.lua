--[[
slurm-elastic job_submit.lua: reject malformed elastic specs at submission, force --requeue on elastic jobs.

An elastic job carries its spec in the job comment, in the one canonical form
of slurm_elastic/spec.py (_CANONICAL and ElasticSpec.to_comment):

  elastic:v1 gpus=MIN-MAX step=K cpus-per-gpu=C mem-per-gpu=MM weight=W[ ckpt=/path]

This file mirrors that grammar exactly (digit counts, canonical spelling:
no leading zeros, no trailing zeros in the weight) and the range checks of
ElasticSpec, so a job Slurm accepts is a job the controller can read. A
comment that does not start with "elastic:v1" is not ours and passes
untouched. Installed by `slurm-elastic admin install-plugin`.
Written for Lua 5.1 (what Slurm links) and runs on 5.3 (the unit tests).
--]]

local PREFIX = "elastic:v1"
local MAX_GPUS = 100000
local MAX_CPUS_PER_GPU = 1024
local MAX_MEM_PER_GPU_MB = 16 * 1024 * 1024
local MAX_WEIGHT = 1000000

-- An unsigned integer of 1..maxdigits digits in canonical spelling (no leading zero).
local function canonical_int(text, maxdigits)
	if text == nil or not string.match(text, "^%d+$") or #text > maxdigits then
		return nil
	end
	if #text > 1 and string.sub(text, 1, 1) == "0" then
		return nil
	end
	return tonumber(text)
end

-- The weight as Python prints it: [0-9]{1,7}(\.[0-9]{1,6})?, canonical (no "1.0", no "01").
local function canonical_weight(text)
	local int, frac = string.match(text, "^(%d+)%.(%d+)$")
	if int == nil then
		int = string.match(text, "^(%d+)$")
		frac = ""
	end
	if int == nil or #int > 7 or #frac > 6 then
		return nil
	end
	if #int > 1 and string.sub(int, 1, 1) == "0" then
		return nil
	end
	if #frac > 0 and string.sub(frac, -1) == "0" then
		return nil
	end
	return tonumber(text)
end

-- Returns nil when `comment` is a valid canonical elastic spec, else the reason.
function elastic_spec_error(comment)
	local min, max, step, cpg, mpg, w, rest = string.match(comment,
		"^elastic:v1 gpus=(%d+)%-(%d+) step=(%d+) cpus%-per%-gpu=(%d+) mem%-per%-gpu=(%d+)M weight=([%d%.]+)(.*)$")
	if min == nil then
		return "not a canonical elastic spec (expected e.g. 'elastic:v1 gpus=1-4 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=1')"
	end
	local nmin, nmax, nstep = canonical_int(min, 6), canonical_int(max, 6), canonical_int(step, 6)
	local ncpg, nmpg, nw = canonical_int(cpg, 5), canonical_int(mpg, 9), canonical_weight(w)
	if nmin == nil or nmax == nil or nstep == nil or ncpg == nil or nmpg == nil or nw == nil then
		return "elastic spec is not in canonical form (numbers without leading zeros, weight like 1 or 0.5)"
	end
	if rest ~= "" then
		local ckpt = string.match(rest, "^ ckpt=(/[A-Za-z0-9%._/%+@%-]*)$")
		if ckpt == nil then
			return "elastic spec: ckpt must be an absolute path of letters, digits and ._/+@- at the end"
		end
		if #ckpt > 1024 then
			return "elastic spec: checkpoint dir is longer than 1024 characters"
		end
		for part in string.gmatch(ckpt, "[^/]+") do
			if part == ".." then
				return "elastic spec: checkpoint dir must not contain '..'"
			end
		end
	end
	if nmin < 1 or nmax < 1 or nstep < 1 or ncpg < 1 or nmpg < 1 then
		return "elastic spec: GPUs, step, CPUs and memory per GPU must be at least 1"
	end
	if nmax > MAX_GPUS then
		return "elastic spec: max GPUs " .. nmax .. " is larger than " .. MAX_GPUS
	end
	if nmin > nmax then
		return "elastic spec: min GPUs " .. nmin .. " exceeds max GPUs " .. nmax
	end
	if nstep > nmax then
		return "elastic spec: GPU step " .. nstep .. " exceeds max GPUs " .. nmax
	end
	if math.fmod(nmin, nstep) ~= 0 or math.fmod(nmax, nstep) ~= 0 then
		return "elastic spec: min and max GPUs must be multiples of the GPU step " .. nstep
	end
	if ncpg > MAX_CPUS_PER_GPU then
		return "elastic spec: CPUs per GPU " .. ncpg .. " is larger than " .. MAX_CPUS_PER_GPU
	end
	if nmpg > MAX_MEM_PER_GPU_MB then
		return "elastic spec: memory per GPU is larger than " .. MAX_MEM_PER_GPU_MB .. "M"
	end
	if nw <= 0 or nw > MAX_WEIGHT then
		return "elastic spec: weight must be > 0 and at most " .. MAX_WEIGHT
	end
	return nil
end

local function claims_elastic(comment)
	return comment ~= nil and string.sub(comment, 1, #PREFIX) == PREFIX
end

function slurm_job_submit(job_desc, part_list, submit_uid)
	local comment = job_desc.comment
	if not claims_elastic(comment) then
		return slurm.SUCCESS
	end
	local err = elastic_spec_error(comment)
	if err ~= nil then
		slurm.log_user("slurm-elastic: rejected: %s", err)
		slurm.log_info("slurm-elastic: rejected a job of uid %s: %s", tostring(submit_uid), err)
		return slurm.ERROR
	end
	-- The controller resizes by requeueing: an elastic job that cannot be requeued cannot be resized.
	job_desc.requeue = 1
	return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
	local comment = job_desc.comment
	if claims_elastic(comment) then
		local err = elastic_spec_error(comment)
		if err ~= nil then
			slurm.log_user("slurm-elastic: rejected: %s", err)
			return slurm.ERROR
		end
	end
	return slurm.SUCCESS
end

if slurm ~= nil and slurm.log_info ~= nil then
	slurm.log_info("slurm-elastic job_submit.lua loaded")
end
return slurm and slurm.SUCCESS or 0
